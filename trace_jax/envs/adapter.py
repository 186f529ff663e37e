"""Adapts a stateful batched environment to the sampler's `env_step` callback.

The sampler hands the environment `(TurnRef(tree, node), generated_text)` pairs. A `ToolEnv`
(`trace_jax.envs.interface`: `reset(example) -> state`, `step_batch(states, texts) -> results`
with `observation_text`, `done`, `reward`, `info`) keeps one state per rollout; in a tree, a turn's
state is a copy of its parent turn's state, so forked branches continue from the state at their
anchor. This adapter keeps the state after every node.
"""

from __future__ import annotations

import copy
from typing import Sequence


class TreeEnvAdapter:
  """Callable `env_step` for `SamplerEngine` over a stateful batched environment.

  Args:
    env: has `reset(example)` and `step_batch(states, action_texts)`; the example is the tree's
      `meta` (the prompt's example dict), with `id` defaulting to the tree's uid.

  Attributes:
    infos: (tree uid, node id) -> the step's `info` dict (action kind, query, em, ...).

  Example (a tool that counts turns; a fork continues from its anchor's count):

  >>> from trace_jax.envs.interface import FunctionEnv, StepResult
  >>> from trace_jax.sampling.config import TurnRef
  >>> from trace_jax.sampling.tree import Tree
  >>> class Count:
  ...   def reset(self, example):
  ...     return {"n": 0}
  ...   def step(self, state, text):
  ...     state["n"] += 1
  ...     return StepResult(f"[{state['n']}]", False, 0.0, {})
  >>> step = TreeEnvAdapter(FunctionEnv(Count(), stop_strings=("</a>",), max_turns=9))
  >>> t = Tree([1, 2], uid=7, meta={"id": "q"})
  >>> a = t.add_node(0)
  >>> b, fork = t.add_node(a.id), t.add_node(a.id)  # two branches from the same anchor
  >>> [obs for obs, done, r in step([(TurnRef(t, a), "x")])]
  ['[1]']
  >>> [obs for obs, done, r in step([(TurnRef(t, b), "x"), (TurnRef(t, fork), "y")])]
  ['[2]', '[2]']
  """

  def __init__(self, env):
    self.env = env
    self.states: dict[tuple[int, int], object] = {}
    self.infos: dict[tuple[int, int], dict] = {}

  def _state_for(self, tree, node):
    if node.parent == 0:
      meta = tree.meta
      return self.env.reset(meta if "id" in meta else {**meta, "id": str(tree.uid)})
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
