"""Adapts a stateful batched environment to the sampler's `env_step` callback.

The sampler hands the environment `(TurnRef(tree, node), generated_text)` pairs. A `ToolEnv`
(`trace_jax.envs.interface`: `reset(example) -> state`, `step_batch(states, texts) -> results`
with `observation_text`, `done`, `reward`, `info`) keeps one state per rollout; in a tree, a turn's
state is a copy of its parent turn's state, so forked branches continue from the state at their
anchor. This adapter keeps the state after every node.

It also checks what the environment gives back (`checks`), so a broken environment fails at the
first reset or step where it shows, naming the example, the turn and the cause: a state that
`copy.deepcopy` cannot copy (TypeError; tried at the first reset of each tree, and wherever a turn
continues from its parent's state), a finished turn whose reward is not a finite number, a turn
that goes on without an observation or whose observation lacks `env.observation_close`, and a
`step_batch` that returns another number of results than it got states (ValueError).

A finished turn whose `info` has `system_cut` (a reason: the tool failed its retries, a time-out)
was ended by the system, not by the policy: its node is marked (`truncated="system:<reason>"`) and
the training loop leaves it out of values, advantages and training (`sampling.tree.is_system_cut`).
"""

from __future__ import annotations

import copy
from typing import Sequence

from trace_jax.envs import checks as checks_lib
from trace_jax.sampling.tree import SYSTEM_CUT_PREFIX


class TreeEnvAdapter:
  """Callable `env_step` for `SamplerEngine` over a stateful batched environment.

  Args:
    env: has `reset(example)` and `step_batch(states, action_texts)`; the example is the tree's
      `meta` (the prompt's example dict), with `id` defaulting to the tree's uid.
    checks: check each reset's state and each step's result (see the module docstring; cheap:
      O(state) once a tree, O(observation) a step). False only to rule the checks out.

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

  def __init__(self, env, checks: bool = True):
    self.env, self.checks = env, checks
    self.observation_close = getattr(env, "observation_close", "") or ""
    self.states: dict[tuple[int, int], object] = {}
    self.infos: dict[tuple[int, int], dict] = {}
    self._copy_checked: set[int] = set()  # uids of the trees whose reset state copied

  @staticmethod
  def _where(tree, node, text=None) -> str:
    """The turn, for an error message: the example's id, the turn number and its text."""
    ex_id = tree.meta.get("id", str(tree.uid))
    turn = f"example {ex_id!r}, turn {node.depth}"
    return turn if text is None else f"{turn} (generated text {checks_lib.show(text, 80)})"

  def _state_for(self, tree, node):
    if node.parent == 0:
      meta = tree.meta
      state = self.env.reset(meta if "id" in meta else {**meta, "id": str(tree.uid)})
      if self.checks and tree.uid not in self._copy_checked:
        checks_lib.check_copyable(self.env, state, f"{self._where(tree, node)}, at reset")
        self._copy_checked.add(tree.uid)
      return state
    parent = self.states.get((tree.uid, node.parent))
    if parent is None:
      raise KeyError(f"no environment state for node {node.parent} of tree {tree.uid}; was it "
                     f"released, or sampled through another adapter?")
    try:
      return copy.deepcopy(parent)
    except Exception as e:  # whatever the copy raises, the cause is the state
      raise checks_lib.not_copyable_error(
          self.env, parent, f"{self._where(tree, node)}, continuing from turn {node.depth - 1}",
          e) from e

  def __call__(self, calls):
    states = [self._state_for(ref.tree, ref.node) for ref, _ in calls]
    results = self.env.step_batch(states, [text for _, text in calls])
    if self.checks:
      if len(results) != len(states):
        raise ValueError(f"{checks_lib.env_name(self.env)}.step_batch returned {len(results)} "
                         f"results for {len(states)} states: one StepResult per state, in order")
      for (ref, text), res in zip(calls, results):
        problem = checks_lib.step_result_problem(res, self.observation_close)
        if problem is not None:
          raise ValueError(f"{self._where(ref.tree, ref.node, text)}: {problem}")
    out = []
    for (ref, _), state, res in zip(calls, states, results):
      key = (ref.tree.uid, ref.node.id)
      self.states[key] = state
      self.infos[key] = getattr(res, "info", {}) or {}
      cut = self.infos[key].get("system_cut") if res.done else None
      if cut:  # ended by the system (a tool that failed its retries): no outcome of the policy's
        ref.node.truncated = f"{SYSTEM_CUT_PREFIX}{cut}"
      out.append((res.observation_text, bool(res.done), float(res.reward)))
    return out

  def renumber(self, tree, moved: dict[int, int]) -> None:
    """The sampler moved `tree`'s node ids (old -> new, `Tree.canonicalize`): the states and
    infos follow their nodes."""
    for d in (self.states, self.infos):
      keys = [k for k in d if k[0] == tree.uid and k[1] in moved]
      vals = [d.pop(k) for k in keys]
      for k, v in zip(keys, vals):
        d[(tree.uid, moved[k[1]])] = v

  def release(self, trees: Sequence) -> None:
    """Forgets the states of `trees` (call with `SamplerEngine.release`)."""
    uids = {t.uid for t in trees}
    for d in (self.states, self.infos):
      for k in [k for k in d if k[0] in uids]:
        del d[k]
    self._copy_checked -= uids


__all__ = ["TreeEnvAdapter"]
