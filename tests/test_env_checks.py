"""A broken task fails at once, naming its cause (`trace_jax.envs.checks`): examples the loop
cannot read, token ids outside the model's vocabulary, a NaN reward, a state `copy.deepcopy` cannot
copy, an observation without its close tag, a turn neither done nor observed. Each environment here
is broken on purpose and driven through `TreeEnvAdapter` by hand (no model); a well-formed one
gives the same results with the checks as without."""

import copy
import doctest
import re
import threading

import pytest

from trace_jax.envs import checks
from trace_jax.envs.adapter import TreeEnvAdapter
from trace_jax.envs.interface import FunctionEnv, StepResult
from trace_jax.sampling.config import TurnRef
from trace_jax.sampling.observation import fit_observation_ids
from trace_jax.sampling.tree import Tree

VOCAB = 16


class Tool:
  """A well-formed toy task: `<call> x </call>` is answered `<r> x </r>`; `<answer> x </answer>`
  ends the rollout, reward 1 when x is the example's answer. The broken tasks below override
  one method."""

  def reset(self, example):
    return {"golds": list(example["answers"]), "calls": []}

  def step(self, state, text):
    if "<answer>" in text:
      got = text.split("<answer>")[-1].split("</answer>")[0].strip()
      return StepResult(None, True, float(got in state["golds"]), {"got": got})
    state["calls"].append(text)
    return StepResult(self.observe(text), False, 0.0, {"n": len(state["calls"])})

  def observe(self, text):
    return f"<r> {text.split('<call>')[-1].split('</call>')[0].strip()} </r>"


def make_env(task=None, max_turns=4):
  return FunctionEnv(task or Tool(), stop_strings=("</call>", "</answer>"),
                     observation_close="</r>", max_turns=max_turns)


def example(i=0, **fields):
  return {"id": f"q{i}", "question": f"what is {i}", "answers": [str(i)],
          "prompt_ids": [1, 3, 4 + i % 8], **fields}


def step(adapter, tree, parent, text):
  """One turn of `tree` after node `parent`: the new node and the adapter's (obs, done, reward)."""
  node = tree.add_node(parent, text=text)
  (out,) = adapter([(TurnRef(tree, node), text)])
  return node, out


# ---- examples --------------------------------------------------------------------------------


def test_example_without_prompt_ids_fails_before_sampling():
  bad = [example(0), {k: v for k, v in example(1).items() if k != "prompt_ids"}]
  with pytest.raises(ValueError, match=r"train example 1 \(id 'q1'\) has no 'prompt_ids'.*"
                     r"make_example"):
    checks.check_examples(bad, VOCAB)
  # Evaluation says so too, before it touches the engine (it raised KeyError: 'prompt_ids').
  from trace_jax.evaluate import evaluate
  with pytest.raises(ValueError, match=r"evaluation example 1 \(id 'q1'\) has no 'prompt_ids'"):
    evaluate(None, bad)


@pytest.mark.parametrize("ids, at, value", [([1, 2, VOCAB], r"\[2\]", str(VOCAB)),
                                            ([1, -3], r"\[1\]", "-3"),
                                            ([1, 2.5], r"\[1\]", "2.5"),
                                            ("a prompt", "", "'a prompt'"),
                                            ([], "", None)])
def test_example_prompt_ids_outside_the_vocabulary(ids, at, value):
  bad = [example(0), example(7, prompt_ids=ids)]
  what = " is empty" if value is None else f"{at} = {value} is"
  with pytest.raises(ValueError, match=rf"train example 1 \(id 'q7'\): prompt_ids{what}"):
    checks.check_examples(bad, VOCAB)
  if value == str(VOCAB):
    with pytest.raises(ValueError, match=rf"vocabulary \[0, {VOCAB}\).*\({VOCAB} ids\)"):
      checks.check_examples(bad, VOCAB)


@pytest.mark.parametrize("fields, match", [
    ({"answers": None}, "answers = None is not a non-empty list of strings"),
    ({"answers": []}, r"answers = \[\] is not"),
    ({"answers": [1998]}, r"answers = \[1998\] is not"),
    ({"hops": "two"}, "hops = 'two' is not an integer"),
    ({"groups": "geo"}, "groups = 'geo' is not a list of labels")])
def test_example_answers_and_what_evaluation_reads(fields, match):
  with pytest.raises(ValueError, match=r"test example 0 \(id 'q0'\): " + match):
    checks.check_examples([example(0, **fields)], VOCAB, name="test")
  with pytest.raises(ValueError, match=r"has no 'answers'"):
    checks.check_examples([{k: v for k, v in example(0).items() if k != "answers"}], VOCAB)


def test_well_formed_examples_pass():
  from trace_jax.assets import make_example
  made = make_example(lambda s: [4 + len(w) % 8 for w in s.split()], 1, "q9", "what is 9",
                      ("9",), "what is 9 ?", hops=2, meta={"k": 1})
  checks.check_examples([example(i) for i in range(20)] + [made], VOCAB)
  checks.check_examples([example(0, answers="0", hops=None, groups=("a", "b"))], VOCAB)
  checks.check_examples([example(0, prompt_ids=[99])], None)  # no vocabulary: the fields only
  checks.check_examples([], VOCAB)


# ---- observation token ids -------------------------------------------------------------------


def test_observation_token_ids_outside_the_vocabulary():
  words = {"<r>": 1, "</r>": 2, "ok": 3}
  encode = checks.CheckedEncode(lambda s: [words.get(w, 40) for w in s.split()], VOCAB)
  assert fit_observation_ids(encode, "<r> ok </r>", 8, "</r>") == [1, 3, 2]
  # As the sampler tokenizes an observation (`engine_loop._fit_observation`).
  with pytest.raises(ValueError, match=r"ids\[1\] = 40 for the text '<r> Orsk </r>'.*"
                     rf"outside the model's vocabulary \[0, {VOCAB}\)"):
    fit_observation_ids(encode, "<r> Orsk </r>", 8, "</r>")
  with pytest.raises(ValueError, match=r"ids\[0\] = -1"):
    checks.CheckedEncode(lambda s: [-1], VOCAB)("x")


# ---- the adapter's checks at reset and step ---------------------------------------------------


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), None, "1"])
def test_done_reward_must_be_finite(reward):
  class Bad(Tool):
    def step(self, state, text):
      res = super().step(state, text)
      return StepResult(None, True, reward, res.info) if res.done else res

  adapter = TreeEnvAdapter(make_env(Bad()))
  tree = Tree([1, 2], uid=3, meta=example(5))
  a, _ = step(adapter, tree, 0, "<call> x </call>")
  with pytest.raises(ValueError, match=rf"example 'q5', turn 2 \(generated text "
                     rf"'<answer> 5 </answer>'\): the turn is done but its reward "
                     rf"{re.escape(repr(reward))} is not a finite number"):
    step(adapter, tree, a.id, "<answer> 5 </answer>")


class Locked(Tool):
  def reset(self, example):
    return dict(super().reset(example), lock=threading.Lock())


class LockedLater(Tool):
  def step(self, state, text):
    state["lock"] = threading.Lock()  # a client opened mid-rollout, kept in the state
    return super().step(state, text)


def test_state_must_copy_at_reset():
  adapter = TreeEnvAdapter(make_env(Locked()))
  tree = Tree([1, 2], uid=3, meta=example(5))
  with pytest.raises(TypeError, match=r"example 'q5', turn 1, at reset: the state of "
                     r"FunctionEnv\(Locked\) \(a dict\) cannot be copied with copy.deepcopy "
                     r"\(TypeError: .*lock.*\): states must be copyable because the branches"):
    step(adapter, tree, 0, "<call> x </call>")


def test_state_must_copy_when_a_turn_continues():
  adapter = TreeEnvAdapter(make_env(LockedLater()))
  tree = Tree([1, 2], uid=3, meta=example(5))
  a, _ = step(adapter, tree, 0, "<call> x </call>")
  with pytest.raises(TypeError, match=r"example 'q5', turn 2, continuing from turn 1: the state "
                     r"of FunctionEnv\(LockedLater\) \(a dict\) cannot be copied.*states must be "
                     r"copyable"):
    step(adapter, tree, a.id, "<answer> 5 </answer>")


def test_observation_must_carry_its_close_tag():
  class Unclosed(Tool):
    def observe(self, text):
      return "<r> " + "found it " * 30  # no </r>

  adapter = TreeEnvAdapter(make_env(Unclosed()))
  tree = Tree([1, 2], uid=3, meta=example(5))
  with pytest.raises(ValueError, match=r"example 'q5', turn 1 \(generated text '<call> x "
                     r"</call>'\): the observation '<r> found it found it.*\.\.\. \(274 chars\) "
                     r"lacks the environment's observation_close '</r>': every observation must "
                     r"end with it"):
    step(adapter, tree, 0, "<call> x </call>")


def test_turn_must_be_done_or_observed():
  class Silent(Tool):
    def observe(self, text):
      return None  # neither an observation nor the end of the rollout

  adapter = TreeEnvAdapter(make_env(Silent()))
  trees = [Tree([1, 2], uid=u, meta=example(u)) for u in (3, 4)]
  texts = ("<answer> 3 </answer>", "<call> y </call>")
  nodes = [t.add_node(0, text=x) for t, x in zip(trees, texts)]
  with pytest.raises(ValueError, match=r"example 'q4', turn 1 \(generated text '<call> y "
                     r"</call>'\): the turn is neither done nor observed \(observation None"):
    adapter([(TurnRef(t, n), n.text) for t, n in zip(trees, nodes)])  # the batch's second


def test_step_batch_gives_one_result_per_state():
  env = make_env()
  short = FunctionEnv.step_batch

  class Short(FunctionEnv):
    def step_batch(self, states, texts):
      return short(self, states, texts)[:-1]

  adapter = TreeEnvAdapter(Short(env.task, env.stop_strings, env.observation_close, 4))
  trees = [Tree([1, 2], uid=u, meta=example(u)) for u in (3, 4)]
  nodes = [t.add_node(0, text="<call> x </call>") for t in trees]
  with pytest.raises(ValueError, match=r"Short\(Tool\).step_batch returned 1 results for 2"):
    adapter([(TurnRef(t, n), n.text) for t, n in zip(trees, nodes)])


# ---- a well-formed environment is unchanged ---------------------------------------------------


def _drive(adapter):
  """A tree with forks, through `adapter`: every call's output, then the kept states and infos."""
  outs = []
  trees = [Tree([1, 2], uid=u, meta=example(u)) for u in (10, 11)]
  meta_only = Tree([1, 2], uid=12, meta={"answers": ["x"]})  # no id: the uid stands in
  firsts = [t.add_node(0, text=f"<call> {t.uid} </call>") for t in trees + [meta_only]]
  outs.append(adapter([(TurnRef(t, n), n.text) for t, n in zip(trees + [meta_only], firsts)]))
  a, b = trees[0].add_node(firsts[0].id), trees[0].add_node(firsts[0].id)  # a fork
  c = trees[1].add_node(firsts[1].id)
  outs.append(adapter([(TurnRef(trees[0], a), "<answer> 10 </answer>"),
                       (TurnRef(trees[0], b), "<call> more </call>"),
                       (TurnRef(trees[1], c), "<call> again </call>")]))
  d = trees[0].add_node(b.id)
  e = trees[1].add_node(c.id)
  outs.append(adapter([(TurnRef(trees[0], d), "<answer> 9 </answer>"),
                       (TurnRef(trees[1], e), "<call> third </call>")]))
  f = trees[1].add_node(e.id)  # the 4th action: FunctionEnv's turn limit ends it, reward 0
  outs.append(adapter([(TurnRef(trees[1], f), "<call> fourth </call>")]))
  return outs, copy.deepcopy(adapter.states), copy.deepcopy(adapter.infos), trees + [meta_only]


def test_a_well_formed_environment_passes_unchanged():
  checked, unchecked = TreeEnvAdapter(make_env()), TreeEnvAdapter(make_env(), checks=False)
  got, want = _drive(checked), _drive(unchecked)
  assert got[:3] == want[:3]
  assert got[0] == [[("<r> 10 </r>", False, 0.0), ("<r> 11 </r>", False, 0.0),
                     ("<r> 12 </r>", False, 0.0)],
                    [(None, True, 1.0), ("<r> more </r>", False, 0.0),
                     ("<r> again </r>", False, 0.0)],
                    [(None, True, 0.0), ("<r> third </r>", False, 0.0)],
                    [(None, True, 0.0)]]
  assert checked._copy_checked == {10, 11, 12}
  checked.release(got[3])
  assert not checked.states and not checked.infos and not checked._copy_checked


def test_the_multihop_env_passes_the_checks():
  from trace_jax.envs.tasks.multihop import MultiHopEnv
  from trace_jax.envs.types import Doc

  class Docs:
    def search(self, queries, k):
      return [[Doc(id="1", title="T", text=f"about {q}")] for q in queries]

  adapter = TreeEnvAdapter(MultiHopEnv(Docs(), max_turns=3, topk=1))
  tree = Tree([1, 2], uid=3, meta=example(5))
  a, (obs, done, _) = step(adapter, tree, 0, "<search> q </search>")
  assert not done and obs.endswith("</information>")
  _, (obs, done, _) = step(adapter, tree, a.id, "no action")  # a corrective observation
  assert not done and "</information>" in obs
  _, (obs, done, reward) = step(adapter, tree, a.id, "<answer> 5 </answer>")
  assert obs is None and done and reward == 1.0


def test_docstring_examples():
  res = doctest.testmod(checks, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  assert res.attempted >= 6 and res.failed == 0
