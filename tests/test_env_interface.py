"""The environment interface (`trace_jax.envs.interface`): `FunctionEnv`'s contract, the
multi-hop env as one implementation, and a toy tool task of this file plugged into training."""

import copy
import json

import pytest

from trace_jax.envs.tasks.multihop import MultiHopEnv
from trace_jax.envs.interface import FunctionEnv, StepResult, ToolEnv, check_env
from trace_jax.envs.types import Doc


class Echo:
  """Every turn is echoed back until `<answer>`; the reward is 1 when it is the example's."""

  def __init__(self):
    self.calls = 0

  def reset(self, example):
    return {"target": example["target"], "turns": []}

  def step(self, state, text):
    self.calls += 1
    state["turns"].append(text)
    if "<answer>" in text:
      got = text.split("<answer>")[-1].split("</answer>")[0].strip()
      return StepResult(None, True, float(got == state["target"]), {"got": got})
    return StepResult(f"<obs> {len(state['turns'])} </obs>", False, 0.0, {})


def test_function_env_contract():
  env = FunctionEnv(Echo(), stop_strings=("</answer>", "</call>"), observation_close="</obs>",
                    max_turns=2)
  assert isinstance(env, ToolEnv)
  check_env(env)
  a, b = env.reset({"target": "x"}), env.reset({"target": "y"})
  r = env.step_batch([a, b], ["<call> 1 </call>", "<answer> y </answer>"])
  assert r[0].observation_text == "<obs> 1 </obs>" and not r[0].done
  assert r[1].done and r[1].reward == 1.0 and r[1].observation_text is None
  fork = copy.deepcopy(a)  # a tree branch continues from a copy of its anchor's state
  r = env.step_batch([a, fork], ["<call> 2 </call>", "<answer> x </answer>"])
  assert r[0].done and r[0].reward == 0.0 and r[0].info["turn_limit"]  # 2 turns, no answer
  assert r[1].reward == 1.0
  with pytest.raises(ValueError, match="already done"):
    env.step_batch([a], ["again"])
  with pytest.raises(ValueError, match="states but"):
    env.step_batch([env.reset({"target": "x"})], [])
  with pytest.raises(ValueError, match="stop_strings"):
    FunctionEnv(Echo(), stop_strings=())
  with pytest.raises(TypeError, match="no stop_strings"):
    check_env(Echo())


class _Retriever:
  def search(self, queries, k):
    return [[Doc(id="1", title="T", text=f"about {q}")] for q in queries]


def test_multihop_env_is_a_tool_env():
  env = MultiHopEnv(_Retriever(), max_turns=3, topk=1)
  assert isinstance(env, ToolEnv)
  s = env.reset({"answers": ["Orsk"], "id": "q1"})  # an example, as the sampler passes it
  assert s.golds == ["Orsk"] and s.example_id == "q1"
  assert env.reset(["Orsk"]).golds == ["Orsk"]  # gold answers still work
  r = env.step_batch([s], ["<search> a </search>"])[0]
  assert r.observation_text.endswith(env.observation_close)
  with pytest.raises(ValueError, match="no 'answers'"):
    env.reset({"id": "q2"})


class WordTokenizer:
  """Space-separated words over a fixed vocabulary (the toy task's own tokenizer)."""

  def __init__(self, words):
    self.vocab = ["<pad>", "<bos>", "<eos>"] + sorted(words)
    self.ids = {w: i for i, w in enumerate(self.vocab)}

  def encode(self, text):
    return [self.ids[w] for w in text.split() if w in self.ids]

  def decode(self, ids):
    return " ".join(self.vocab[int(i)] for i in ids)


def test_a_toy_task_trains_a_trace_tree_step(tmp_path):
  """A task written here (examples, tokenizer, `FunctionEnv`) plugged into `train.train` with
  `trace_tree`: the run samples trees through the toy environment and updates."""

  from test_train_smoke import smoke_args

  from trace_jax import train as T
  from trace_jax.assets import Assets

  words = ["<call>", "</call>", "<answer>", "</answer>", "<obs>", "</obs>", "find"] + [
      str(i) for i in range(10)]
  tok = WordTokenizer(words)
  task = Echo()
  env = FunctionEnv(task, stop_strings=("</call>", "</answer>"), observation_close="</obs>",
                    max_turns=2)

  def example(i):
    return dict(id=f"toy-{i}", question=f"find {i}", answers=[str(i)], target=str(i),
                prompt_ids=[tok.ids["<bos>"]] + tok.encode(f"find {i}"))

  assets = Assets(encode=tok.encode, decode=tok.decode, bos_id=1, eos_id=2,
                  vocab_size=len(tok.vocab), train=[example(i) for i in range(10)],
                  test=[example(i) for i in range(4)], retriever=None, env=env)
  from configs import mhqa

  c = mhqa.get_config("smoke")
  for arg in smoke_args(str(tmp_path), 1)[1:]:  # the smoke run's sizes
    key, value = arg[2:].split("=", 1)
    if key != "workdir":
      sec, field = key.split(".")[1:]
      c[sec][field] = type(c[sec][field])(value)
  c.method, c.workdir, c.env.max_turns = "trace_tree", str(tmp_path / "run"), 2
  summary = T.train(mhqa.validate(c), assets=assets)
  assert summary["method"] == "trace_tree" and summary["rollouts"] > 0
  assert task.calls >= summary["rollouts"]  # every rollout stepped the toy environment
  recs = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  step = next(r for r in recs if r.get("step") == 1 and "loss" in r)
  assert step["generated_tokens_total"] > 0
