"""Batched multi-hop QA environment: ReAct turns in, observations and rewards out.

The environment is tokenizer-agnostic: it takes the text each rollout generated this turn and
returns the observation text to append. The sampler owns tokens; `segments_to_tokens` turns the
(text, is_generated) segments of a rollout into ids and the mask of trainable tokens.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Optional, Sequence, Union

import numpy as np

from trace_jax.envs import react
from trace_jax.envs.scoring import RewardFn, exact_match, f1, get_reward_fn
from trace_jax.envs.types import Retriever

log = logging.getLogger(__name__)


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


@dataclasses.dataclass(frozen=True)
class StepResult:
  """observation_text is None when the rollout is done (nothing to append)."""

  observation_text: Optional[str]
  done: bool
  reward: float
  info: dict


class MultiHopEnv:
  """Search/answer environment over any `Retriever`.

  Args:
    retriever: answers all searches of a `step_batch` in one `search` call.
    reward_fn: a `RewardFn` or its name (`em`, `f1`, `em_format`); called as
      reward_fn(prediction, golds, format_ok) with format_ok False after any invalid action.
    max_turns: actions allowed per rollout; a rollout that has not answered by then ends with
      reward 0.
    topk: passages per search.
  """

  def __init__(self, retriever: Retriever, reward_fn: Union[str, RewardFn] = "em",
               max_turns: int = 5, topk: int = 3):
    if max_turns < 1 or topk < 1:
      raise ValueError(f"max_turns and topk must be >= 1, got {max_turns}, {topk}")
    self.retriever = retriever
    self.reward_fn = get_reward_fn(reward_fn) if isinstance(reward_fn, str) else reward_fn
    self.max_turns = max_turns
    self.topk = topk
    self.counters = dict.fromkeys(
        ["steps", "searches", "answers", "invalid_actions", "turn_limit", "retriever_calls",
         "retriever_errors", "error_observations"], 0)

  def reset(self, golds: Union[str, Sequence[str]], example_id: str = "") -> EnvState:
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
    try:
      hits = self.retriever.search(queries, self.topk)
      if len(hits) != len(queries):
        raise RuntimeError(f"retriever returned {len(hits)} results for {len(queries)} queries")
    except Exception as e:  # Any tool failure must not kill the rollouts.
      log.warning("retriever failed on %d queries: %r", len(queries), e)
      self.counters["retriever_errors"] += 1
      self.counters["error_observations"] += len(queries)
      return [(react.format_error_observation(), 0)] * len(queries)
    return [(react.format_observation(docs[: self.topk]), len(docs[: self.topk])) for docs in hits]


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
