"""Adapts a stateful batched environment to the sampler's `env_step` callback.

The sampler hands the environment `(TurnRef(tree, node), generated_text)` pairs. A stateful
environment (e.g. `trace_jax.envs.env.MultiHopEnv`: `reset(golds, example_id) -> state`,
`step_batch(states, texts) -> results` with `observation_text`, `done`, `reward`, `info`) keeps one
state per rollout; in a tree, a turn's state is a copy of its parent turn's state, so forked
branches continue from the state at their anchor. This adapter keeps the state after every node.
"""

from __future__ import annotations

import copy
from typing import Sequence


class TreeEnvAdapter:
  """Callable `env_step` for `SamplerEngine` over a stateful batched environment.

  Args:
    env: has `reset(golds, example_id=...)` and `step_batch(states, action_texts)`.
    golds_key: key of the gold answers in `Tree.meta`; `Tree.meta.get("id")` names the example.

  Attributes:
    infos: (tree uid, node id) -> the step's `info` dict (action kind, query, em, ...).
  """

  def __init__(self, env, golds_key: str = "golds"):
    self.env, self.golds_key = env, golds_key
    self.states: dict[tuple[int, int], object] = {}
    self.infos: dict[tuple[int, int], dict] = {}

  def _state_for(self, tree, node):
    if node.parent == 0:
      return self.env.reset(tree.meta[self.golds_key],
                            example_id=str(tree.meta.get("id", tree.uid)))
    parent = self.states.get((tree.uid, node.parent))
    if parent is None:
      raise KeyError(f"no environment state for node {node.parent} of tree {tree.uid}; was it "
                     f"released, or sampled through another adapter?")
    return copy.deepcopy(parent)

  def __call__(self, calls):
    states = [self._state_for(ref.tree, ref.node) for ref, _ in calls]
    results = self.env.step_batch(states, [text for _, text in calls])
    out = []
    for (ref, _), state, res in zip(calls, states, results):
      key = (ref.tree.uid, ref.node.id)
      self.states[key] = state
      self.infos[key] = getattr(res, "info", {})
      out.append((res.observation_text, bool(res.done), float(res.reward)))
    return out

  def release(self, trees: Sequence) -> None:
    """Forgets the states of `trees` (call with `SamplerEngine.release`)."""
    uids = {t.uid for t in trees}
    for d in (self.states, self.infos):
      for k in [k for k in d if k[0] in uids]:
        del d[k]


__all__ = ["TreeEnvAdapter"]
