"""Batched multi-hop QA environment: ReAct turns in, observations and rewards out.

The environment is tokenizer-agnostic: it takes the text each rollout generated this turn and
returns the observation text to append. The sampler owns tokens; `segments_to_tokens` turns the
(text, is_generated) segments of a rollout into ids and the mask of trainable tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable, Mapping, Optional, Sequence, Union

import numpy as np

from trace_jax.envs import react
from trace_jax.envs.interface import StepResult
from trace_jax.envs.scoring import RewardFn, exact_match, f1, get_reward_fn
from trace_jax.envs.types import Retriever

log = logging.getLogger(__name__)

# Bytes per observation by default: top-k passages of a Wikipedia-style corpus fit many times over;
# a server that returns megabytes of text cannot flood the context.
DEFAULT_MAX_OBS_BYTES = 16384


@dataclasses.dataclass
class EnvState:
  """Per-rollout state. `turn` counts actions taken, invalid ones included."""

  golds: list
  example_id: str = ""
  turn: int = 0
  done: bool = False
  n_invalid: int = 0
  n_searches: int = 0
  prediction: Optional[str] = None
  reward: float = 0.0

  def fork(self) -> "EnvState":
    """An independent copy, for branching several continuations from one turn boundary."""
    return dataclasses.replace(self, golds=list(self.golds))


class MultiHopEnv:
  """Search/answer environment over any `Retriever`: the multi-hop QA task's `ToolEnv`
  (`trace_jax.envs.interface`).

  Args:
    retriever: answers all searches of a `step_batch` in one `search` call.
    reward_fn: a `RewardFn` or its name (`em`, `f1`, `em_format`); called as
      reward_fn(prediction, golds, format_ok) with format_ok False after any invalid action.
    max_turns: actions allowed per rollout; a rollout that has not answered by then ends with
      reward 0.
    topk: passages per search; never more are shown, whatever the retriever returns.
    max_obs_bytes: UTF-8 bytes per observation, tags included (0: no cap); passages are cut
      fairly and `</information>` is kept (`react.fit_observation`).
    max_obs_tokens, encode: with both, observations are cut in token space (under `encode`, the
      policy's tokenizer) to at most `max_obs_tokens` tokens, closing tag included.

  `retriever_stats(reset=True)` gives the tool's health since the last reset (calls, queries,
  errors, retries, latency, truncations) for the training loop's metrics.
  """

  def __init__(self, retriever: Retriever, reward_fn: Union[str, RewardFn] = "em",
               max_turns: int = 5, topk: int = 3, *,
               max_obs_bytes: int = DEFAULT_MAX_OBS_BYTES, max_obs_tokens: int = 0,
               encode: Optional[Callable[[str], Sequence[int]]] = None):
    if max_turns < 1 or topk < 1:
      raise ValueError(f"max_turns and topk must be >= 1, got {max_turns}, {topk}")
    if max_obs_bytes and max_obs_bytes < react.MIN_OBS_BYTES:
      raise ValueError(f"max_obs_bytes={max_obs_bytes} must be 0 (no cap) or at least "
                       f"{react.MIN_OBS_BYTES}")
    if max_obs_tokens < 0:
      raise ValueError(f"max_obs_tokens must be >= 0, got {max_obs_tokens}")
    self.retriever = retriever
    self.reward_fn = get_reward_fn(reward_fn) if isinstance(reward_fn, str) else reward_fn
    self.max_turns = max_turns
    self.topk = topk
    self.max_obs_bytes, self.max_obs_tokens, self.encode = max_obs_bytes, max_obs_tokens, encode
    self.counters = dict.fromkeys(
        ["steps", "searches", "answers", "invalid_actions", "turn_limit", "retriever_calls",
         "retriever_errors", "error_observations", "obs_truncated", "obs_docs_dropped"], 0)
    self._stats_lock = threading.Lock()
    self._window = _zero_window()

  stop_strings = react.STOP_STRINGS
  observation_close = react.INFO_CLOSE

  def reset(self, golds: Union[str, Sequence[str], Mapping], example_id: str = "") -> EnvState:
    """A fresh state: from an example (a mapping with `answers`, or `golds`, and `id`) or from
    the gold answers themselves."""
    if isinstance(golds, Mapping):
      example = golds
      if "answers" not in example and "golds" not in example:
        raise ValueError(f"example {example.get('id', '?')!r} has no 'answers'")
      golds = example["answers"] if "answers" in example else example["golds"]
      example_id = str(example.get("id", example_id))
    golds = [golds] if isinstance(golds, str) else list(golds)
    if not golds:
      raise ValueError("an example needs at least one gold answer")
    return EnvState(golds=golds, example_id=example_id)

  def step_batch(self, states: Sequence[EnvState], action_texts: Sequence[str]) -> list[StepResult]:
    """Applies one generated turn to each state (in place) and returns its result."""
    if len(states) != len(action_texts):
      raise ValueError(f"{len(states)} states but {len(action_texts)} action texts")
    for i, s in enumerate(states):
      if s.done:
        raise ValueError(f"state {i} ({s.example_id!r}) is already done")
    actions = [react.parse_action(t) for t in action_texts]
    results: list[Optional[StepResult]] = [None] * len(states)
    pending = []  # Indices whose search goes to the retriever.
    for i, (s, a) in enumerate(zip(states, actions)):
      s.turn += 1
      self.counters["steps"] += 1
      info = {"action": a.kind, "turn": s.turn, "error": a.error}
      if a.kind == "answer":
        self.counters["answers"] += 1
        results[i] = self._finish(s, a.content, info)
        continue
      if a.kind == "invalid":
        s.n_invalid += 1
        self.counters["invalid_actions"] += 1
      if s.turn >= self.max_turns:  # No turn left to use an observation: stop here.
        self.counters["turn_limit"] += 1
        info["turn_limit"] = True
        results[i] = self._finish(s, None, info)
      elif a.kind == "invalid":
        results[i] = StepResult(react.format_invalid_observation(a.error), False, 0.0, info)
      else:
        s.n_searches += 1
        self.counters["searches"] += 1
        info["query"] = a.content
        pending.append((i, info))
    if pending:
      observations = self._search([actions[i].content for i, _ in pending])
      for (i, info), (obs, n_docs) in zip(pending, observations):
        info["n_docs"] = n_docs
        results[i] = StepResult(obs, False, 0.0, info)
    return results

  def _finish(self, s: EnvState, prediction: Optional[str], info: dict) -> StepResult:
    s.done, s.prediction = True, prediction
    s.reward = float(self.reward_fn(prediction, s.golds, s.n_invalid == 0))
    info.update(prediction=prediction, em=exact_match(prediction, s.golds),
                f1=f1(prediction, s.golds), n_invalid=s.n_invalid)
    return StepResult(None, True, s.reward, info)

  def _search(self, queries: list[str]) -> list[tuple[str, int]]:
    """One retriever call for the batch; a failure becomes an error observation for each."""
    self.counters["retriever_calls"] += 1
    t0 = time.monotonic()
    try:
      hits = self.retriever.search(queries, self.topk)
      if len(hits) != len(queries):
        raise RuntimeError(f"retriever returned {len(hits)} results for {len(queries)} queries")
    except Exception as e:  # Any tool failure must not kill the rollouts.
      log.warning("retriever failed on %d queries: %r", len(queries), e)
      self.counters["retriever_errors"] += 1
      self.counters["error_observations"] += len(queries)
      self._record(time.monotonic() - t0, len(queries), errors=1)
      return [(react.format_error_observation(), 0)] * len(queries)
    out, truncated, dropped = [], 0, 0
    for docs in hits:
      docs = list(docs)
      dropped += max(0, len(docs) - self.topk)
      docs = docs[: self.topk]
      text, cut = react.fit_observation(docs, self.max_obs_bytes, self.max_obs_tokens, self.encode)
      truncated += cut
      out.append((text, len(docs)))
    self.counters["obs_truncated"] += truncated
    self.counters["obs_docs_dropped"] += dropped
    self._record(time.monotonic() - t0, len(queries), obs_truncated=truncated,
                 obs_docs_dropped=dropped)
    return out

  def _record(self, seconds: float, n_queries: int, **counts) -> None:
    with self._stats_lock:
      w = self._window
      w["calls"] += 1
      w["queries"] += n_queries
      w["latency_sum_s"] += seconds
      w["latency_max_s"] = max(w["latency_max_s"], seconds)
      for k, v in counts.items():
        w[k] += v

  def retriever_stats(self, reset: bool = False) -> dict:
    """The retriever's health since the last reset, as flat metrics for `metrics.jsonl`.

    Keys: `retriever_calls` (one per batched search), `retriever_queries`, `retriever_errors`
    (calls that fell back to an error observation), `retriever_latency_mean_s` and
    `retriever_latency_max_s` (per call, retries included), `retriever_retries`,
    `retriever_timeouts` and `retriever_requests` (HTTP attempts; 0 for in-process retrievers),
    `obs_truncated` (observations cut to the byte or token cap) and `obs_docs_dropped` (passages
    beyond top-k that the retriever returned anyway).
    """
    with self._stats_lock:
      w = dict(self._window)
      if reset:
        self._window = _zero_window()
    inner = getattr(self.retriever, "stats", None)
    tool = inner(reset=reset) if callable(inner) else {}
    return {
        "retriever_calls": w["calls"],
        "retriever_queries": w["queries"],
        "retriever_errors": w["errors"],
        "retriever_latency_mean_s": w["latency_sum_s"] / w["calls"] if w["calls"] else 0.0,
        "retriever_latency_max_s": w["latency_max_s"],
        "retriever_retries": int(tool.get("retries", 0)),
        "retriever_timeouts": int(tool.get("timeouts", 0)),
        "retriever_requests": int(tool.get("requests", 0)),
        "obs_truncated": w["obs_truncated"],
        "obs_docs_dropped": w["obs_docs_dropped"],
    }


def _zero_window() -> dict:
  return {"calls": 0, "queries": 0, "errors": 0, "latency_sum_s": 0.0, "latency_max_s": 0.0,
          "obs_truncated": 0, "obs_docs_dropped": 0}


Segment = tuple[Union[str, Sequence[int]], bool]


def segments_to_tokens(
    segments: Sequence[Segment], encode: Callable[[str], Sequence[int]]
) -> tuple[np.ndarray, np.ndarray]:
  """Concatenates (text or ids, is_generated) segments into ids and a trainable mask.

  Returns:
    ids: int32[T]; mask: bool[T], True on tokens of generated segments (the policy's own
    tokens), False on prompt and observation tokens.
  """
  ids, mask = [], []
  for content, generated in segments:
    seg_ids = list(encode(content)) if isinstance(content, str) else [int(t) for t in content]
    ids += seg_ids
    mask += [bool(generated)] * len(seg_ids)
  return np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=bool)
