"""Checks that a task plugged into training is well formed, so that a broken one fails at once with
its cause named instead of late (a KeyError after setup, a NaN loss, a traceback from inside
`copy.deepcopy`) or not at all.

  check_examples(examples, vocab_size)  every example dict has what the loop reads: non-empty
                     integer `prompt_ids` in [0, vocab_size) and gold `answers` (call it before
                     sampling starts);
  CheckedEncode(encode, vocab_size)     the task's `encode` for the sampler, raising when it gives
                     a token id outside the model's vocabulary (the sampler tokenizes observations
                     with it);
  check_copyable, step_result_problem   what `adapter.TreeEnvAdapter` checks at each reset and step:
                     the state survives `copy.deepcopy`, a finished turn's reward is finite, a turn
                     that goes on has an observation that carries `observation_close`.

Each check is O(its input) and raises ValueError or TypeError naming the example or turn, the
field, the value and what to do. Plain Python and numpy (no jax).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, Collection, Iterable, Mapping, Optional, Sequence

import numpy as np

SHOW_CHARS = 120  # characters of a text an error message shows


def show(value: Any, limit: int = SHOW_CHARS) -> str:
  """`repr(value)`, cut to `limit` characters (a cut string says its length).

  >>> show("x" * 300, 10)
  "'xxxxxxxxx... (300 chars)"
  """
  r = repr(value)
  if len(r) <= limit:
    return r
  return r[:limit] + "..." + (f" ({len(value)} chars)" if isinstance(value, str) else "")


def _first_bad_id(ids: Any, vocab_size: Optional[int]) -> Optional[tuple[str, Any, str]]:
  """None when `ids` is a flat sequence of integers in [0, vocab_size) (any range when
  `vocab_size` is None); else (where: '' or '[i]', the bad value, why)."""
  if isinstance(ids, (str, bytes)):
    return "", ids, "is text, not token ids"
  try:
    arr = np.asarray(ids)
  except (TypeError, ValueError, OverflowError) as e:  # ragged nesting and the like
    return "", ids, f"is not a flat sequence of token ids ({e})"
  if arr.ndim != 1:
    return "", ids, f"has shape {arr.shape}, not a flat sequence of token ids"
  if arr.size == 0 or (arr.dtype.kind in "iu" and (
      vocab_size is None or (int(arr.min()) >= 0 and int(arr.max()) < vocab_size))):
    return None
  # The slow path, only when something is wrong: the first bad id, as the caller gave it.
  for i, t in enumerate(ids if isinstance(ids, (list, tuple)) else arr.tolist()):
    if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
      return f"[{i}]", t, "is not an integer token id"
    if t < 0:
      return f"[{i}]", t, "is negative, not a token id"
    if vocab_size is not None and t >= vocab_size:
      return f"[{i}]", t, f"is outside the model's vocabulary [0, {vocab_size})"
  return "", ids, f"has dtype {arr.dtype}, not integer token ids"


def _example_name(example: Any, index: int, name: str) -> str:
  ex_id = example.get("id") if isinstance(example, Mapping) else None
  return f"{name} example {index}" + (f" (id {ex_id!r})" if ex_id is not None else "")


def check_examples(examples: Sequence[Mapping], vocab_size: Optional[int],
                   name: str = "train") -> None:
  """Raises ValueError naming the first example the training loop cannot read.

  An example is a dict with `prompt_ids` (the prompt's token ids: non-empty, integers in
  [0, vocab_size), the model's embedding rows; `vocab_size` None skips the range) and `answers`
  (the gold answers evaluation scores against: a non-empty list of strings, or one string), as
  `assets.make_example` builds it. Optional fields are checked when present: `hops` (an integer
  evaluation groups by) and `groups` (a list of labels, not one string). O(total prompt tokens):
  some 20 us an example of 300 tokens.

  >>> check_examples([{"id": "q0", "prompt_ids": [1, 5], "answers": ["x"]}], vocab_size=8)
  >>> check_examples([{"id": "q0", "prompt_ids": [1, 9], "answers": ["x"]}], vocab_size=8)
  Traceback (most recent call last):
  ...
  ValueError: train example 0 (id 'q0'): prompt_ids[1] = 9 is outside the model's vocabulary ...
  """
  if vocab_size is not None and (not isinstance(vocab_size, (int, np.integer))
                                 or isinstance(vocab_size, bool) or vocab_size < 1):
    raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
  for i, e in enumerate(examples):
    who = _example_name(e, i, name)
    if not isinstance(e, Mapping):
      raise ValueError(f"{who} is a {type(e).__name__}, not a dict: an example is a dict with "
                       f"prompt_ids and answers (see trace_jax.assets.make_example)")
    if "prompt_ids" not in e:
      raise ValueError(f"{who} has no 'prompt_ids' (its keys: {sorted(map(str, e))}): examples "
                       f"carry their prompt pre-tokenized with the task's encode; build them with "
                       f"trace_jax.assets.make_example(encode, bos_id, id, question, answers, "
                       f"prompt_text)")
    ids = e["prompt_ids"]
    bad = _first_bad_id(ids, vocab_size)
    if bad is not None:
      at, value, why = bad
      raise ValueError(
          f"{who}: prompt_ids{at} = {show(value)} {why}: prompt_ids are the prompt's token ids "
          f"from the task's tokenizer, which must be the model's"
          f"{'' if vocab_size is None else f' ({vocab_size} ids)'}; re-encode the prompt with "
          f"the tokenizer the model was trained with")
    if len(ids) == 0:
      raise ValueError(f"{who}: prompt_ids is empty: every prompt needs at least one token "
                       f"(encode its prompt text, with the BOS id first if the model uses one)")
    if "answers" not in e:
      raise ValueError(f"{who} has no 'answers' (its keys: {sorted(map(str, e))}): evaluation "
                       f"scores the final answer against them; give the gold answers as a list "
                       f"of strings")
    answers = e["answers"]
    golds = [answers] if isinstance(answers, str) else answers
    if (isinstance(golds, (bytes, Mapping)) or not isinstance(golds, Collection) or not golds
        or not all(isinstance(a, str) for a in golds)):
      raise ValueError(f"{who}: answers = {show(answers)} is not a non-empty list of strings "
                       f"(the gold answers evaluation scores against)")
    hops = e.get("hops")
    if hops is not None:
      try:
        int(hops)
      except (TypeError, ValueError):
        raise ValueError(f"{who}: hops = {show(hops)} is not an integer (evaluation groups by "
                         f"it; leave it out or None when the task has no hop count)") from None
    groups = e.get("groups")
    if groups is not None and (isinstance(groups, (str, bytes))
                               or not isinstance(groups, Iterable)):
      raise ValueError(f"{who}: groups = {show(groups)} is not a list of labels (evaluation "
                       f"reports EM per label)")


class CheckedEncode:
  """The task's `encode` (str -> token ids), raising ValueError when it gives an id outside the
  model's vocabulary [0, vocab_size) or a non-integer: give it to `SamplerEngine` in place of
  `encode`, which tokenizes every observation with it. O(ids) a call.

  >>> enc = CheckedEncode(lambda s: [len(w) for w in s.split()], vocab_size=6)
  >>> enc("ab cde")
  [2, 3]
  >>> enc("ab abcdefg")
  Traceback (most recent call last):
  ...
  ValueError: the task's encode gave ids[1] = 7 for the text 'ab abcdefg' ...
  """

  def __init__(self, encode: Callable[[str], Sequence[int]], vocab_size: int):
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) or (
        vocab_size < 1):
      raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    self.encode, self.vocab_size = encode, int(vocab_size)

  def __call__(self, text: str):
    ids = self.encode(text)
    bad = _first_bad_id(ids, self.vocab_size)
    if bad is not None:
      at, value, why = bad
      raise ValueError(
          f"the task's encode gave ids{at} = {show(value)} for the text {show(text)} (an "
          f"observation or a stop string the sampler tokenizes), which {why}: the task's "
          f"tokenizer must be the model's (vocab_size {self.vocab_size}); an id beyond the "
          f"embedding makes the loss NaN")
    return ids


def env_name(env: Any) -> str:
  """The environment's class name, with the task's for a wrapper that has one (`FunctionEnv`)."""
  name = type(env).__name__
  task = getattr(env, "task", None)
  return f"{name}({type(task).__name__})" if task is not None else name


def not_copyable_error(env: Any, state: Any, where: str, err: BaseException) -> TypeError:
  """The TypeError for a state `copy.deepcopy` failed on (raise it `from err`)."""
  return TypeError(
      f"{where}: the state of {env_name(env)} (a {type(state).__name__}) cannot be copied with "
      f"copy.deepcopy ({type(err).__name__}: {show(str(err))}): states must be copyable because "
      f"the branches of a tree fork from a copy of their anchor's state; keep open resources "
      f"(clients, locks, files, generators) on the environment, not in the state, or give the "
      f"state's class a __deepcopy__")


def check_copyable(env: Any, state: Any, where: str) -> None:
  """Raises TypeError when `copy.deepcopy(state)` fails (what a fork does). O(state)."""
  try:
    copy.deepcopy(state)
  except Exception as e:  # whatever the copy raises, the cause is the state
    raise not_copyable_error(env, state, where, e) from e


def step_result_problem(res: Any, observation_close: str) -> Optional[str]:
  """What is wrong with one step's result, or None: a finished turn (`done`) whose reward is not a
  finite number, or a turn that goes on without an observation (a string containing
  `observation_close` when that is not ''). O(observation)."""
  if res.done:
    r = res.reward
    try:
      value = None if isinstance(r, (str, bytes)) else float(r)
    except (TypeError, ValueError):
      value = None
    if value is None or not math.isfinite(value):
      return (f"the turn is done but its reward {show(r)} is not a finite number: a NaN/inf "
              f"reward makes the loss NaN; return a finite float reward")
    return None
  obs = res.observation_text
  if not isinstance(obs, str):
    return (f"the turn is neither done nor observed (observation {show(obs)}, done False): a "
            f"step either ends the rollout (done=True with its reward) or returns the "
            f"observation text the policy reads next")
  if observation_close and observation_close not in obs:
    return (f"the observation {show(obs)} lacks the environment's observation_close "
            f"{observation_close!r}: every observation must end with it (the sampler keeps it "
            f"last when it cuts a long observation, so the policy sees where tool output ends); "
            f"append it, or set observation_close='' if the task has no closing tag")
  return None


def check_step_result(res: Any, observation_close: str, where: str) -> None:
  """Raises ValueError `where: <problem>` when `step_result_problem` finds one.

  >>> from trace_jax.envs.interface import StepResult
  >>> check_step_result(StepResult("<r> 5 </r>", False, 0.0, {}), "</r>", "turn 1")
  >>> check_step_result(StepResult(None, True, float("nan"), {}), "</r>", "turn 2")
  Traceback (most recent call last):
  ...
  ValueError: turn 2: the turn is done but its reward nan is not a finite number: ...
  """
  problem = step_result_problem(res, observation_close)
  if problem is not None:
    raise ValueError(f"{where}: {problem}")


__all__ = ["CheckedEncode", "check_copyable", "check_examples", "check_step_result", "env_name",
           "not_copyable_error", "show", "step_result_problem"]
