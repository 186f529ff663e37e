"""The environment interface: what a multi-turn tool task gives the sampler, and what it gets back.

A task is a set of examples plus an environment. The sampler owns tokens and never sees the task:
it decodes a turn until one of the environment's `stop_strings` (or EOS, or the turn's token
limit), hands the turn's *text* to the environment, and appends the observation text it gets back
(tokenized with the policy's tokenizer); a turn that ends the rollout carries its reward.

An environment (`ToolEnv`) has
  stop_strings       strings that end an action turn (`</search>`, `</answer>`, `</calculate>`);
  observation_close  the string that ends every observation it writes ('' if none), so the sampler
                     can tell an observation's tokens from the policy's;
  max_turns          actions a rollout may take (the environment ends it there);
  reset(example)     a fresh per-rollout state for an example (a dict: the task's own fields, e.g.
                     `answers`, plus `id`);
  step_batch(states, texts) -> [StepResult]
                     applies one generated turn to each state, in place (batched, so a tool that
                     serves many calls at once, such as a search server, is called once a batch);
                     a `StepResult` is (observation_text or None when done, done, reward, info).
A state must survive `copy.deepcopy`: in a tree a forked branch continues from a copy of the state
at its anchor turn (`adapter.TreeEnvAdapter`). A tool whose calls are one at a time implements
`step(state, text)` and `reset` and wraps itself in `FunctionEnv`.

What the adapter checks at every reset and step (`checks`; a broken environment fails there,
naming the example, the turn and the cause): the state copies; a done turn's reward is a finite
number; a turn that is not done has an observation, which contains `observation_close`. Before
sampling, `checks.check_examples` checks the examples (`prompt_ids` in the model's vocabulary,
`answers`), and `checks.CheckedEncode` wraps the `encode` the sampler tokenizes observations with.

What the sampler gives back: one `sampling.tree.Tree` per prompt, its nodes the turns (`text` the
generated turn, `obs_text` the observation after it, `gen_ids`/`logprobs` the policy's tokens and
their log-probabilities) and its leaves the finished rollouts with their `reward`.

A toy task end to end: `FunctionEnv`'s example.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Protocol, Sequence, runtime_checkable


@dataclasses.dataclass(frozen=True)
class StepResult:
  """observation_text is None when the rollout is done (nothing to append). A rollout the system
  ends (a tool that failed its retries, a time-out), not the policy, says so with
  `info["system_cut"] = reason`: it is left out of training instead of taught as a failure."""

  observation_text: Optional[str]
  done: bool
  reward: float
  info: dict


@runtime_checkable
class ToolEnv(Protocol):
  """A batched multi-turn tool environment (see the module docstring): `stop_strings`,
  `observation_close`, `max_turns`, `reset(example) -> state` and
  `step_batch(states, texts) -> [StepResult]`.

  >>> from trace_jax.envs.tasks.multihop import MultiHopEnv
  >>> isinstance(MultiHopEnv(retriever=None), ToolEnv)
  True
  >>> MultiHopEnv.stop_strings
  ('</search>', '</answer>')
  """

  stop_strings: tuple
  observation_close: str
  max_turns: int

  def reset(self, example: Mapping[str, Any]) -> Any:
    ...

  def step_batch(self, states: Sequence[Any], action_texts: Sequence[str]) -> list[StepResult]:
    ...


class FunctionEnv:
  """A `ToolEnv` over a task whose tool is called one rollout at a time.

  Args:
    task: has `reset(example) -> state` and `step(state, text) -> StepResult`.
    stop_strings, observation_close: as in `ToolEnv`.
    max_turns: a rollout whose `max_turns`-th action does not end it is ended there with reward
      0 (info `turn_limit`); the task never sees a later turn.

  Example (a toy task: arithmetic through a tool):

  >>> from trace_jax.envs.interface import StepResult
  >>> class Adder:
  ...   def reset(self, example):
  ...     return {"target": example["answer"], "calls": 0}
  ...   def step(self, state, text):
  ...     state["calls"] += 1
  ...     if "<add>" in text:
  ...       a, b = text.split("<add>")[1].split("</add>")[0].split("+")
  ...       return StepResult(f"<result>{int(a) + int(b)}</result>", False, 0.0, {})
  ...     answer = text.split("<answer>")[-1].split("</answer>")[0].strip()
  ...     return StepResult(None, True, float(answer == state["target"]), {})
  >>> env = FunctionEnv(Adder(), stop_strings=("</add>", "</answer>"),
  ...                   observation_close="</result>", max_turns=3)
  >>> s = env.reset({"answer": "5", "id": "q0"})
  >>> env.step_batch([s], ["<add>2+3</add>"])[0].observation_text
  '<result>5</result>'
  >>> env.step_batch([s], ["<answer> 5 </answer>"])[0].reward
  1.0
  """

  def __init__(self, task, stop_strings: Sequence[str], observation_close: str = "",
               max_turns: int = 5):
    if max_turns < 1:
      raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    if not stop_strings or not all(isinstance(s, str) and s for s in stop_strings):
      raise ValueError(f"stop_strings must be non-empty strings, got {stop_strings!r}")
    self.task = task
    self.stop_strings = tuple(stop_strings)
    self.observation_close = observation_close
    self.max_turns = max_turns

  def reset(self, example: Mapping[str, Any]) -> dict:
    return {"task": self.task.reset(example), "turn": 0, "done": False}

  def step_batch(self, states: Sequence[dict], action_texts: Sequence[str]) -> list[StepResult]:
    if len(states) != len(action_texts):
      raise ValueError(f"{len(states)} states but {len(action_texts)} action texts")
    out = []
    for i, (s, text) in enumerate(zip(states, action_texts)):
      if s["done"]:
        raise ValueError(f"state {i} is already done")
      s["turn"] += 1
      res = self.task.step(s["task"], text)
      if not res.done and s["turn"] >= self.max_turns:
        res = StepResult(None, True, 0.0, dict(res.info, turn_limit=True))
      s["done"] = res.done
      out.append(res)
    return out


def _between(text: str, open_: str, close: str) -> Optional[str]:
  i = text.find(open_)
  if i < 0:
    return None
  j = text.find(close, i + len(open_))
  return None if j < 0 else text[i + len(open_):j]


def tool_or_answer(text, tool: tuple[str, str], answer: tuple[str, str] = ("<answer>", "</answer>")
                   ) -> tuple[str, str]:
  """The action of a turn of a one-tool task, whichever complete tag pair comes first:
  ("answer", content), ("tool", content), or ("invalid", reason: "unclosed tag" or "no action").
  Never raises (non-text counts as no action).

  >>> tool_or_answer("<think> x </think> <calc> 1+1 </calc>", ("<calc>", "</calc>"))
  ('tool', ' 1+1 ')
  """
  text = text if isinstance(text, str) else ""
  ia, it = text.find(answer[0]), text.find(tool[0])
  got_answer, got_tool = _between(text, *answer), _between(text, *tool)
  if got_answer is not None and (got_tool is None or ia < it):
    return "answer", got_answer
  if got_tool is not None:
    return "tool", got_tool
  return "invalid", "unclosed tag" if ia >= 0 or it >= 0 else "no action"


def check_env(env) -> None:
  """Raises TypeError naming what `env` lacks to be a `ToolEnv`."""
  missing = [name for name in ("stop_strings", "observation_close", "max_turns", "reset",
                               "step_batch") if not hasattr(env, name)]
  if missing:
    raise TypeError(f"{type(env).__name__} is not a ToolEnv: it has no {', '.join(missing)} "
                    f"(see trace_jax.envs.interface)")


__all__ = ["FunctionEnv", "StepResult", "ToolEnv", "check_env", "tool_or_answer"]
