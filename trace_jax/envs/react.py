"""The ReAct turn protocol with Search-R1 tags: parsing actions and formatting observations.

A turn is `<think> ... </think>` followed by exactly one action, `<search> query </search>` or
`<answer> text </answer>`. Generation stops at a closing action tag (`STOP_STRINGS`); the tool's
reply comes back as `<information> ... </information>`. Everything here is text in, text out, so
the same code serves the synthetic world's word-level tokenizer and real subword tokenizers.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Literal, Optional, Sequence, Union

from trace_jax.envs.types import Doc

# The token-level cut that keeps `</information>` last lives with the sampler, which applies it
# (given the marker by its caller); re-exported here as part of the protocol.
from trace_jax.sampling.observation import truncate_observation  # noqa: F401

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
SEARCH_OPEN, SEARCH_CLOSE = "<search>", "</search>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
INFO_OPEN, INFO_CLOSE = "<information>", "</information>"
ALL_TAGS = (
    THINK_OPEN, THINK_CLOSE, SEARCH_OPEN, SEARCH_CLOSE, ANSWER_OPEN, ANSWER_CLOSE, INFO_OPEN,
    INFO_CLOSE,
)
STOP_STRINGS = (SEARCH_CLOSE, ANSWER_CLOSE)

_TAG_RE = re.compile("|".join(re.escape(t) for t in ALL_TAGS))

ActionKind = Literal["search", "answer", "invalid"]


@dataclasses.dataclass(frozen=True)
class Action:
  """A parsed turn. `content` is the stripped query or answer ('' when invalid)."""

  kind: ActionKind
  content: str = ""
  error: Optional[str] = None


def _invalid(error: str) -> Action:
  return Action("invalid", "", error)


def parse_action(text: Union[str, bytes, None]) -> Action:
  """Parses one generated turn. Never raises; malformed output gives kind='invalid' and a reason.

  Valid: at most one think block, closed, before exactly one closed search or answer block whose
  content is non-empty and holds no tag. Text outside the tags is tolerated (models emit spaces
  and newlines); a generated `<information>` tag (a hallucinated observation) is not.
  """
  if text is None:
    return _invalid("empty output")
  if isinstance(text, (bytes, bytearray)):
    text = bytes(text).decode("utf-8", errors="replace")
  if not isinstance(text, str):
    return _invalid(f"output is {type(text).__name__}, not text")
  if not text.strip():
    return _invalid("empty output")

  tags = [(m.group(0), m.start(), m.end()) for m in _TAG_RE.finditer(text)]
  names = [t[0] for t in tags]
  if INFO_OPEN in names or INFO_CLOSE in names:
    return _invalid("generated an <information> tag")

  n_actions = names.count(SEARCH_OPEN) + names.count(ANSWER_OPEN)
  if n_actions == 0:
    if SEARCH_CLOSE in names or ANSWER_CLOSE in names:
      return _invalid("closing action tag without opening tag")
    return _invalid("no <search> or <answer> action")
  if n_actions > 1:
    return _invalid("several actions in one turn")

  # The think block, if any, must be closed before the action starts.
  if names.count(THINK_OPEN) > 1 or names.count(THINK_CLOSE) > 1:
    return _invalid("several think blocks")
  if names.count(THINK_OPEN) != names.count(THINK_CLOSE):
    return _invalid("unbalanced think tags")

  open_idx = names.index(SEARCH_OPEN) if SEARCH_OPEN in names else names.index(ANSWER_OPEN)
  open_name = names[open_idx]
  close_name = SEARCH_CLOSE if open_name == SEARCH_OPEN else ANSWER_CLOSE
  kind: ActionKind = "search" if open_name == SEARCH_OPEN else "answer"
  wrong_close = ANSWER_CLOSE if close_name == SEARCH_CLOSE else SEARCH_CLOSE
  if wrong_close in names:
    return _invalid(f"mismatched closing tag {wrong_close}")
  if names.count(close_name) == 0:
    return _invalid(f"unclosed {open_name} tag")
  if names.count(close_name) > 1:
    return _invalid(f"several {close_name} tags")
  close_idx = names.index(close_name)
  if close_idx < open_idx:
    return _invalid(f"{close_name} before {open_name}")
  if close_idx != open_idx + 1:
    return _invalid(f"nested tag inside {open_name}")
  if THINK_OPEN in names:
    think_open, think_close = names.index(THINK_OPEN), names.index(THINK_CLOSE)
    if not think_open < think_close < open_idx:
      return _invalid("think block must be closed before the action")

  content = text[tags[open_idx][2]:tags[close_idx][1]].strip()
  if not content:
    return _invalid(f"empty {kind}")
  return Action(kind, content, None)


def format_docs(docs: Sequence[Doc]) -> str:
  """Search-R1's passage listing: `Doc 1(Title: t) text` one per line."""
  return "\n".join(_doc_line(i, d) for i, d in enumerate(docs))


def _doc_line(i: int, d: Doc) -> str:
  return f"Doc {i + 1}(Title: {d.title}) {d.text}"


def format_observation(docs: Sequence[Doc]) -> str:
  """Wraps retrieved passages in information tags; an empty result says so."""
  body = format_docs(docs) if docs else "No results."
  return f"{INFO_OPEN}{body}{INFO_CLOSE}"


# The smallest byte budget `fit_observation` accepts: the tags plus a little text.
MIN_OBS_BYTES = 64


def _cut_utf8(text: str, n_bytes: int) -> str:
  """The longest prefix of `text` of at most `n_bytes` UTF-8 bytes (never half a character)."""
  return text.encode("utf-8")[:max(0, n_bytes)].decode("utf-8", errors="ignore")


def _format_within(docs: Sequence[Doc], max_bytes: int) -> str:
  """`format_observation(docs)` cut to `max_bytes` UTF-8 bytes, closing tag kept.

  The budget is shared fairly over the passages (water-filling: short ones keep all their text,
  long ones are cut to an equal share), so one huge passage cannot crowd out the others.
  """
  full = format_observation(docs)
  if len(full.encode("utf-8")) <= max_bytes:
    return full
  lines = [_doc_line(i, d) for i, d in enumerate(docs)] or ["No results."]
  sizes = [len(line.encode("utf-8")) for line in lines]
  avail = max_bytes - len(INFO_OPEN) - len(INFO_CLOSE) - (len(lines) - 1)
  if avail <= 0:
    return f"{INFO_OPEN}{INFO_CLOSE}"
  keep = [0] * len(lines)
  for rank, i in enumerate(sorted(range(len(lines)), key=sizes.__getitem__)):
    keep[i] = min(sizes[i], max(0, avail) // (len(lines) - rank))
    avail -= keep[i]
  body = "\n".join(_cut_utf8(line, n) for line, n in zip(lines, keep))
  return f"{INFO_OPEN}{body}{INFO_CLOSE}"


def fit_observation(docs: Sequence[Doc], max_bytes: int = 0, max_tokens: int = 0,
                    encode: Optional[Callable[[str], Sequence[int]]] = None) -> tuple[str, bool]:
  """The observation for `docs`, bounded in bytes and in tokens, closing tag always kept.

  Args:
    docs: the passages to show (the caller keeps at most top-k of them).
    max_bytes: UTF-8 bytes of the whole observation, tags included (0: no byte cap; else at least
      `MIN_OBS_BYTES`).
    max_tokens: tokens of the whole observation under `encode` (0 or no `encode`: no token cap).
      The text is cut (fairly over the passages) until `encode` of the result fits, so a sampler
      that keeps `max_tokens` observation tokens never cuts off `</information>`.
    encode: str -> token ids, the policy's tokenizer.
  Returns:
    (text, truncated): the observation, and whether anything was cut.
  """
  if max_bytes and max_bytes < MIN_OBS_BYTES:
    raise ValueError(f"max_bytes={max_bytes} must be 0 (no cap) or at least {MIN_OBS_BYTES}")
  full = format_observation(docs)
  size = len(full.encode("utf-8"))
  hi = min(size, max_bytes) if max_bytes else size
  text = _format_within(docs, hi)
  if max_tokens and encode is not None and len(encode(text)) > max_tokens:
    # Largest byte budget whose text fits in max_tokens: binary search (about log2(bytes) encodes).
    lo = len(INFO_OPEN) + len(INFO_CLOSE)
    while lo < hi:
      mid = (lo + hi + 1) // 2
      if len(encode(_format_within(docs, mid))) <= max_tokens:
        lo = mid
      else:
        hi = mid - 1
    text = _format_within(docs, lo)
    if len(encode(text)) > max_tokens:  # Even the bare tags do not fit: keep them alone.
      text = f"{INFO_OPEN}{INFO_CLOSE}"
  return text, text != full


def format_invalid_observation(error: Optional[str] = None) -> str:
  """Short corrective reply to an invalid action; kept brief so it costs few tokens."""
  del error  # The reason goes to the env's info dict; the text stays fixed and learnable.
  return (
      f"{INFO_OPEN}Invalid action. Use {SEARCH_OPEN} query {SEARCH_CLOSE} or "
      f"{ANSWER_OPEN} answer {ANSWER_CLOSE}.{INFO_CLOSE}"
  )


def format_error_observation() -> str:
  """Reply when the retriever failed; the rollout continues."""
  return f"{INFO_OPEN}Search failed. Try again.{INFO_CLOSE}"
