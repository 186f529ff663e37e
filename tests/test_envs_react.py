"""ReAct parsing, observation formatting and truncation, and the batched environment."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_jax.envs import react
from trace_jax.envs.tasks.multihop import MultiHopEnv, segments_to_tokens
from trace_jax.envs.types import Doc

# --- parse_action ----------------------------------------------------------------------------

VALID = [
    ("<think> hmm </think> <search> founded Zantro </search>", "search", "founded Zantro"),
    ("<think>x</think><answer> Orsk </answer>", "answer", "Orsk"),
    ("<search>q</search>", "search", "q"),  # The think block is optional.
    ("\n<think> a </think>\n\n<answer>New York City</answer>\n", "answer", "New York City"),
    ("preamble <answer> 42 </answer>", "answer", "42"),
    ("<think>think about <b>html</b></think><search>a < b</search>", "search", "a < b"),
]


@pytest.mark.parametrize("text,kind,content", VALID)
def test_valid_actions(text, kind, content):
  a = react.parse_action(text)
  assert (a.kind, a.content, a.error) == (kind, content, None)


INVALID = [
    ("", "empty output"),
    ("   \n", "empty output"),
    ("<think> only thinking </think>", "no <search> or <answer>"),
    ("Orsk", "no <search> or <answer>"),
    ("<search> unclosed", "unclosed <search>"),
    ("<answer> unclosed", "unclosed <answer>"),
    ("<search>   </search>", "empty search"),
    ("<answer></answer>", "empty answer"),
    ("<search>a</search><search>b</search>", "several actions"),
    ("<search>a</search><answer>b</answer>", "several actions"),
    ("<search> a <answer> b </answer> </search>", "several actions"),
    ("<search> a <think> b </think> </search>", "nested tag"),
    ("<search> a </answer>", "mismatched closing"),
    ("</search> a <search>", "before"),
    ("x </search>", "closing action tag without opening"),
    ("<think> a <search> q </search>", "unbalanced think"),
    ("a </think> <search> q </search>", "unbalanced think"),
    ("<search> q </search> <think> late </think>", "think block must be closed before"),
    ("<think>a</think><think>b</think><answer>c</answer>", "several think"),
    ("<search> q </search> </search>", "several </search>"),
    ("<search> q </search><information>fake</information>", "<information>"),
]


@pytest.mark.parametrize("text,error", INVALID)
def test_invalid_actions(text, error):
  a = react.parse_action(text)
  assert a.kind == "invalid" and a.content == ""
  assert error in a.error


def test_hostile_inputs_never_raise():
  assert react.parse_action(None).kind == "invalid"
  assert react.parse_action(b"\xff\xfe<answer> x </answer>").content == "x"
  assert react.parse_action(b"\xff\xfe\xfd").kind == "invalid"
  assert react.parse_action(12345).kind == "invalid"
  huge = "<think>" + "blah " * 200_000 + "</think><answer> Orsk </answer>"
  assert react.parse_action(huge).content == "Orsk"
  assert react.parse_action("<search>" * 10_000).kind == "invalid"
  assert react.parse_action("\x00\ud800<answer>\x00</answer>").kind == "answer"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(list(react.ALL_TAGS) + ["q", " ", "x y", "\n", "<", ">", "é"]),
                max_size=12).map("".join))
def test_parse_is_total_and_consistent(text):
  a = react.parse_action(text)
  assert a.kind in ("search", "answer", "invalid")
  if a.kind == "invalid":
    assert a.error and a.content == ""
  else:
    assert a.error is None and a.content == a.content.strip() and a.content
    assert not any(t in a.content for t in react.ALL_TAGS)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=200))
def test_parse_arbitrary_bytes(data):
  assert react.parse_action(data).kind in ("search", "answer", "invalid")


# --- observations ------------------------------------------------------------------------------

def test_format_observation_search_r1_layout():
  docs = [Doc("1", "Zantro", "Zantro is based in Orsk ."),
          Doc("2", "Kelmor", "Kelmor founded Zantro .")]
  assert react.format_observation(docs) == (
      "<information>Doc 1(Title: Zantro) Zantro is based in Orsk .\n"
      "Doc 2(Title: Kelmor) Kelmor founded Zantro .</information>")
  assert react.format_observation([]) == "<information>No results.</information>"
  inv = react.format_invalid_observation("whatever")
  assert inv.startswith("<information>") and inv.endswith("</information>") and "Invalid" in inv


def test_truncate_observation_keeps_closing_tag():
  close = [98, 99]
  ids = [1] + list(range(10, 30)) + close
  out = react.truncate_observation(ids, 8, close)
  assert out == [1, 10, 11, 12, 13, 14, 98, 99]
  assert react.truncate_observation(ids, len(ids), close) == ids  # Fits: unchanged.
  assert react.truncate_observation([1, 2, 3, 4, 5], 4, close) == [1, 2, 98, 99]  # No tag yet.
  assert react.truncate_observation(ids, 2, close) == close
  with pytest.raises(ValueError, match="closing tag"):
    react.truncate_observation(ids, 1, close)


# --- environment -------------------------------------------------------------------------------

class FakeRetriever:
  def __init__(self, fail=False):
    self.calls, self.fail = [], fail

  def search(self, queries, k):
    self.calls.append((list(queries), k))
    if self.fail:
      raise ConnectionError("down")
    return [[Doc(str(i), f"T{q}", f"text {q}") for i in range(k + 2)] for q in queries]


def test_step_batch_one_retriever_call_and_rewards():
  ret = FakeRetriever()
  env = MultiHopEnv(ret, "em", max_turns=3, topk=2)
  states = [env.reset(["Orsk"]) for _ in range(4)]
  out = env.step_batch(states, [
      "<think>a</think><search> q1 </search>",
      "<answer> orsk </answer>",
      "<search> q2 </search>",
      "garbage",
  ])
  assert ret.calls == [(["q1", "q2"], 2)]
  assert out[0].observation_text.count("Doc ") == 2  # Sliced to topk.
  assert "Tq1" in out[0].observation_text and "Tq2" in out[2].observation_text
  assert (out[1].done, out[1].reward, out[1].observation_text) == (True, 1.0, None)
  assert out[1].info["em"] == 1.0
  assert not out[3].done and "Invalid" in out[3].observation_text
  assert out[3].info["action"] == "invalid" and states[3].turn == 1 and states[3].n_invalid == 1
  with pytest.raises(ValueError, match="already done"):
    env.step_batch([states[1]], ["<answer>x</answer>"])
  out2 = env.step_batch([states[3]], ["<answer> Orsk </answer>"])
  assert out2[0].reward == 1.0  # em ignores the earlier format error.


def test_format_reward_sees_invalid_turns():
  env = MultiHopEnv(FakeRetriever(), "em_format", max_turns=4, topk=1)
  s = env.reset("Orsk")
  env.step_batch([s], ["nonsense"])
  assert env.step_batch([s], ["<answer>Orsk</answer>"])[0].reward == pytest.approx(0.9)


def test_turn_limit_ends_with_zero_reward_without_searching():
  ret = FakeRetriever()
  env = MultiHopEnv(ret, "em", max_turns=2, topk=1)
  s = env.reset(["Orsk"])
  assert not env.step_batch([s], ["<search>a</search>"])[0].done
  last = env.step_batch([s], ["<search>b</search>"])[0]
  assert (last.done, last.reward, last.observation_text) == (True, 0.0, None)
  assert last.info["turn_limit"] and len(ret.calls) == 1
  s2 = env.reset(["Orsk"])
  env.step_batch([s2], ["bad"])
  assert env.step_batch([s2], ["bad again"])[0].done  # Invalid actions count as turns.
  assert env.counters["turn_limit"] == 2


def test_retriever_failure_becomes_error_observation():
  env = MultiHopEnv(FakeRetriever(fail=True), "em", max_turns=3, topk=2)
  states = [env.reset(["x"]), env.reset(["x"])]
  out = env.step_batch(states, ["<search>a</search>", "<search>b</search>"])
  assert all(not r.done and "Search failed" in r.observation_text for r in out)
  assert env.counters["retriever_errors"] == 1 and env.counters["error_observations"] == 2
  assert env.step_batch(states[:1], ["<answer>x</answer>"])[0].reward == 1.0


def test_injected_retriever_errors_fail_the_first_calls_of_one_process_only():
  from faults import FailingRetriever, process_fault  # tests/faults.py
  assert process_fault("", "f", 0) is None and process_fault("0:2", "f", 0) == "2"
  assert process_fault("1:2", "f", 0) is None  # another process's fault (this is process 0)
  for bad in ("2", "a:1", "0:x", "-1:2"):
    with pytest.raises(ValueError, match="expected PROCESS:VALUE"):
      process_fault(bad, "retriever_errors", 0)
  ret = FakeRetriever()
  env = MultiHopEnv(FailingRetriever(ret, 2), "em", max_turns=4, topk=1)
  s = env.reset(["Orsk"])
  outs = [env.step_batch([s], [f"<search>q{i}</search>"])[0] for i in range(3)]
  assert ["Search failed" in o.observation_text for o in outs] == [True, True, False]
  assert len(ret.calls) == 1 and env.counters["retriever_errors"] == 2


def test_forked_states_are_independent():
  env = MultiHopEnv(FakeRetriever(), "em", max_turns=3, topk=1)
  root = env.reset(["Orsk"])
  env.step_batch([root], ["<search>q</search>"])
  a, b = root.fork(), root.fork()
  out = env.step_batch([a, b], ["<answer>Orsk</answer>", "<search>again</search>"])
  assert (out[0].reward, out[0].done, out[1].done) == (1.0, True, False)
  assert (root.turn, root.done, a.turn, b.turn) == (1, False, 2, 2)
  assert env.step_batch([b], ["<search>last</search>"])[0].info["turn_limit"]


def test_env_argument_errors():
  with pytest.raises(ValueError):
    MultiHopEnv(FakeRetriever(), "em", max_turns=0)
  with pytest.raises(ValueError, match="unknown reward"):
    MultiHopEnv(FakeRetriever(), "nope")
  env = MultiHopEnv(FakeRetriever())
  with pytest.raises(ValueError, match="gold"):
    env.reset([])
  with pytest.raises(ValueError, match="2 states but 1"):
    env.step_batch([env.reset("a"), env.reset("b")], ["x"])


def test_segments_to_tokens_mask():
  encode = lambda s: [len(w) for w in s.split()]
  ids, mask = segments_to_tokens(
      [("question : hi", False), ("<think> a </think>", True), ([7, 8], False), ([9], True)],
      encode)
  np.testing.assert_array_equal(ids, [8, 1, 2, 7, 1, 8, 7, 8, 9])
  np.testing.assert_array_equal(mask, [0, 0, 0, 1, 1, 1, 0, 0, 1])
  assert ids.dtype == np.int32 and mask.dtype == bool


# --- prompts -----------------------------------------------------------------------------------

def test_prompts():
  from trace_jax.envs import prompts

  plain = prompts.build_search_r1_prompt("who founded Zantro")
  assert plain.endswith("Question: who founded Zantro?\n") and "<search> query </search>" in plain

  class ChatTokenizer:
    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
      assert not tokenize and add_generation_prompt
      return "<|user|>" + messages[0]["content"] + "<|assistant|>"

  chat = prompts.build_search_r1_prompt("who founded Zantro?", ChatTokenizer())
  assert chat.startswith("<|user|>Answer the given question.") and chat.endswith("<|assistant|>")

  class NoTemplate:
    chat_template = None

  assert prompts.build_search_r1_prompt("q?", NoTemplate()) == prompts.search_r1_prompt("q?")
  assert prompts.synthetic_prompt(" what is the city of Zantro ? ") == (
      "question : what is the city of Zantro ?\n")


def test_package_exports_lazily():
  import trace_jax.envs as envs

  for name in envs.__all__:
    assert getattr(envs, name) is not None
  assert envs.parse_action is react.parse_action and envs.MultiHopEnv is MultiHopEnv
  with pytest.raises(AttributeError, match="no attribute 'nope'"):
    envs.nope  # noqa: B018
