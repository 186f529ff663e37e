"""Function calling: call validation under hostile outputs, the API's state, the generator and its
expert (replayed through the tokenizer), and the BFCL-style reader and checker."""

import json

import numpy as np
import pytest

from trace_jax.envs.tasks.fc_world import (
    ApiState, CallError, FCWorld, FCWorldConfig, build_fc_tokenizer, calls_match, compact,
    execute, expert_segments, generate_fc_world, make_fc_env, parse_call, read_bfcl,
)
from trace_jax.envs.interface import ToolEnv

STATE = {"users": {"Mira": {"id": 12, "balance": 100}, "Arno": {"id": 30, "balance": 5}},
         "orders": {"101": {"user_id": 12, "total": 40, "refunded": False},
                    "105": {"user_id": 12, "total": 15, "refunded": False}}}


@pytest.mark.parametrize("text,why", [
    ("{not json", "invalid json"), ("[1, 2]", "an object"), ('"x"', "an object"),
    ('{"name": "rm_rf", "arguments": {}}', "unknown function"),
    ('{"name": "get_balance", "arguments": {}}', "missing argument user_id"),
    ('{"name": "get_balance", "arguments": {"user_id": 1, "x": 2}}', "unknown argument x"),
    ('{"name": "get_balance", "arguments": {"user_id": "12"}}', "must be an integer"),
    ('{"name": "get_balance", "arguments": {"user_id": true}}', "must be an integer"),
    ('{"name": "get_balance", "arguments": {"user_id": 1' + "0" * 30 + '}}', "must be an integer"),
    ('{"name": "find_user", "arguments": {"name": {"a": {"b": {"c": {"d": 1}}}}}}', "an object"),
    ('{"name": "find_user", "arguments": [1]}', "must be an object"),
    ('{"name": "find_user", "arguments": {"name": "x"}, "also": 1}', "only name and arguments"),
    ("[" * 5000 + "]" * 5000, "longer than"), ('{"name": ' + "[" * 100 + "]" * 100 + "}",
                                               "an object"),
])
def test_calls_are_validated(text, why):
  with pytest.raises(CallError, match=why):
    parse_call(text)


def test_api_state():
  api = ApiState(json.loads(json.dumps(STATE["users"])), json.loads(json.dumps(STATE["orders"])))
  assert execute(api, "find_user", {"name": "Mira"}) == {"user_id": 12}
  assert execute(api, "list_orders", {"user_id": 12}) == {"order_ids": [101, 105]}
  assert execute(api, "refund", {"order_id": 105}) == {"ok": True}
  assert api.users["Mira"]["balance"] == 115
  with pytest.raises(CallError, match="already refunded"):
    execute(api, "refund", {"order_id": 105})
  with pytest.raises(CallError, match="covered by the balance"):
    execute(api, "transfer", {"from_id": 30, "to_id": 12, "amount": 50})
  with pytest.raises(CallError, match="no such user"):
    execute(api, "find_user", {"name": "Zed"})


def test_env_episode_and_hostile_turns():
  env = make_fc_env(max_turns=6)
  assert isinstance(env, ToolEnv)
  ex = {"id": "t", "state": STATE, "answers": ["done"],
        "expected_state": {"users": {"Mira": {"id": 12, "balance": 80},
                                     "Arno": {"id": 30, "balance": 25}},
                           "orders": STATE["orders"]}}
  s = env.reset(ex)
  step = lambda t: env.step_batch([s], [t])[0]  # noqa: E731
  assert "error : invalid json" in step("<call> {oops </call>").observation_text
  assert "unclosed tag" in step("<call> {").observation_text
  assert "unknown function" in step('<call> {"name": "drop", "arguments": {}} </call>'
                                    ).observation_text
  # the tokenizer's spaced-out decode of a call is joined back
  r = step('<call> { " name " : " transfer " , " arguments " : { " from _ id " : 1 2 , '
           '" to _ id " : 3 0 , " amount " : 2 0 } } </call>')
  assert r.observation_text == '<response> {"ok": true} </response>'
  r = step("<answer> done </answer>")
  assert r.done and r.reward == 1.0 and r.info["state_ok"]
  s = env.reset(ex)  # the same answer without the transfer: the state is wrong
  assert env.step_batch([s], ["<answer> done </answer>"])[0].reward == 0.0
  assert s["task"]["api"].users["Mira"]["balance"] == 100  # the example's state was copied
  assert STATE["users"]["Mira"]["balance"] == 100
  with pytest.raises(ValueError, match="no 'state'"):
    env.reset({"answers": ["x"]})
  assert compact('{ " a _ b " : 1 2 }') == '{"a_b":12}'


def test_generator_expert_tokenizer(tmp_path):
  w = generate_fc_world(FCWorldConfig(n_train=400, n_test=80))
  assert generate_fc_world(FCWorldConfig(n_train=400, n_test=80)).train[3] == w.train[3]
  rng = np.random.default_rng(0)
  ok = {}
  for p in w.train:
    ok.setdefault(p.template, []).append(expert_segments(w, p, rng)[1])
  for t, v in ok.items():  # each template's planted mistake, at the template's rate (4 sigma)
    rate = w.expert_rates[t]
    assert abs(np.mean(v) - rate) < 4 * np.sqrt(rate * (1 - rate) / len(v)) + 0.02, t
  tok, env = build_fc_tokenizer(), make_fc_env()
  for p in w.test:  # the oracle, replayed through the tokenizer and the environment, succeeds
    segs, good = expert_segments(w, p, rng, oracle=True)
    assert good
    s = env.reset(dict(id=p.id, state=p.state, answers=p.answers,
                       expected_state=p.expected_state))
    for text, gen in segs[1:]:
      if gen:
        ids = tok.encode(text).ids
        assert tok.token_to_id("<unk>") not in ids
        r = env.step_batch([s], [tok.decode(ids)])[0]
    assert r.done and r.reward == 1.0, p.task
  w.save(str(tmp_path))
  assert FCWorld.load(str(tmp_path)).test == w.test


def test_bfcl_reader_and_checker(tmp_path):
  recs = [{"id": "simple_0", "question": [[{"role": "user", "content": "area of a 3 by 4 box"}]],
           "function": [{"name": "area", "parameters": {"type": "dict", "properties": {
               "w": {"type": "integer"}, "h": {"type": "integer"}}}}]},
          {"id": "simple_1", "question": "weather in Oslo", "function": {"name": "weather"},
           "ground_truth": [{"weather": {"city": ["Oslo", "oslo"], "unit": ["", "c"]}}]}]
  p = tmp_path / "q.jsonl"
  p.write_text("\n".join(json.dumps(r) for r in recs))
  a = tmp_path / "a.json"
  a.write_text(json.dumps([{"id": "simple_0", "ground_truth": [{"area": {"w": [3], "h": [4]}}]}]))
  out = read_bfcl(str(p), str(a))
  assert out[0]["question"] == "area of a 3 by 4 box"
  assert out[1]["functions"][0]["name"] == "weather"
  assert calls_match([{"name": "area", "arguments": {"w": 3, "h": 4}}], out[0]["ground_truth"])
  assert not calls_match([{"name": "area", "arguments": {"w": 4, "h": 3}}],
                         out[0]["ground_truth"])
  gt = out[1]["ground_truth"]
  assert calls_match([{"name": "weather", "arguments": {"city": "oslo"}}], gt)  # unit optional
  assert not calls_match([{"name": "weather", "arguments": {"city": "Oslo", "x": 1}}], gt)
  assert not calls_match([], gt) and not calls_match([{"name": "weather"}], gt)
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"question": "q"}\n')
  with pytest.raises(ValueError, match="needs question and function"):
    read_bfcl(str(bad))


def test_fc_main_job_smoke(tmp_path):
  """`launch/train.py --config=configs/fc.py:smoke`, one step: warm start on the expert's traces,
  a trace_tree step through the API, held-out EM (the environment's reward) per template."""
  from test_train_smoke import tool_task_smoke

  summary, evals = tool_task_smoke(tmp_path, "configs/fc.py:smoke")
  assert summary["rollouts"] > 0 and summary["warm_start"]["rows"] > 0
  assert evals and any(k.startswith("eval_em_group/") for k in evals[0])
