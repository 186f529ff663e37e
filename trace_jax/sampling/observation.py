"""Fitting an environment's observation into a token budget.

The sampler knows no turn protocol: an observation's closing marker (e.g. a ReAct environment's
`</information>`) is only a string its caller names (`SamplerEngine(observation_close=...)`), so a
cut can keep that marker last and the policy never continues inside an observation whose end it was
not shown. With no marker the cut is a plain prefix. Plain Python (no numpy, no jax), so the
environments can import it too.
"""

from __future__ import annotations

from typing import Callable, Sequence


def truncate_observation(token_ids: Sequence[int], max_tokens: int,
                         closing_ids: Sequence[int]) -> list[int]:
  """Cuts an observation to at most `max_tokens` tokens, keeping the closing marker at the end.

  Args:
    token_ids: int[T] token ids of one observation, normally ending with `closing_ids`.
    max_tokens: the budget, closing marker included.
    closing_ids: int[C] the ids of the closing marker (e.g. `</information>`) in the caller's
      tokenizer.
  Returns:
    int[min(T, max_tokens)]: unchanged if it fits, else a prefix followed by `closing_ids`.
  """
  token_ids, closing_ids = list(token_ids), list(closing_ids)
  if max_tokens < len(closing_ids):
    raise ValueError(
        f"max_tokens={max_tokens} cannot hold the closing tag ({len(closing_ids)} ids)")
  if len(token_ids) <= max_tokens:
    return token_ids
  body = token_ids
  if closing_ids and body[-len(closing_ids):] == closing_ids:
    body = body[:-len(closing_ids)]
  return body[: max_tokens - len(closing_ids)] + closing_ids


def fit_observation_ids(encode: Callable[[str], Sequence[int]], obs_text: str, limit: int,
                        close: str = "") -> list[int]:
  """At most `limit` token ids of `obs_text`: int[min(T, limit)].

  A cut keeps the text from the last `close` on (the marker, encoded on its own) as the last ids
  when it fits in `limit`; otherwise, or without `close` (""), or when the text has no `close`,
  the cut is the first `limit` ids.
  """
  obs = [int(t) for t in encode(obs_text)]
  if len(obs) <= limit:
    return obs
  k = obs_text.rfind(close) if close else -1
  if k < 0 or limit <= 0:
    return obs[:limit]
  closing = [int(t) for t in encode(obs_text[k:])]
  if len(closing) > limit:
    return obs[:limit]
  body = [int(t) for t in encode(obs_text[:k])]
  return truncate_observation(body + closing, limit, closing)


__all__ = ["fit_observation_ids", "truncate_observation"]
