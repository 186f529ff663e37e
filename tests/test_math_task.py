"""Tool-use math: the safe calculator, the task's environment under hostile outputs, the
generator and its expert, the tokenizer, and the real-data reader."""

import json
from fractions import Fraction

import numpy as np
import pytest

from trace_jax.envs.tasks.calculator import CalculatorError, calculate, format_value
from trace_jax.envs.interface import ToolEnv
from trace_jax.envs.tasks.math_world import (
    MathWorld, MathWorldConfig, answers_match, build_math_tokenizer, expert_segments,
    final_answer, generate_math_world, make_math_env, read_math_jsonl, squash_digits,
)


def test_calculator_values():
  assert calculate("12 * (3 + 4) / 2") == 42
  assert calculate("1/3*3") == 1 and calculate("-2 ** 3") == -8
  assert calculate("2**-2") == Fraction(1, 4)
  assert calculate("7 // 2") == 3 and calculate("7 % 4") == 3 and calculate("2.5 * 2") == 5
  assert format_value(Fraction(5, 2)) == "2.5" and format_value(Fraction(1, 3)) == "0.333333"
  assert format_value(Fraction(-4)) == "-4"


@pytest.mark.parametrize("text,why", [
    ("__import__('os').system('x')", "only numbers"), ("a + 1", "only numbers"),
    ("1 / 0", "division by zero"), ("9" * 40, "too large"), ("10 ** 100", "exponent"),
    ("(" * 30 + "1" + ")" * 30, "nested"), ("1 +", "not an arithmetic"), ("", "empty"),
    ("1" + " + 1" * 200, "longer than"), ("99999999 * 99999999 * 99999999", "too large"),
    ("[1, 2]", "only numbers"), ("1 < 2", "only numbers"), ("'1'", "only numbers"),
    (None, "expected text"), ("2 ** 0.5", "exponent"), ("0 ** -1", "division by zero"),
])
def test_calculator_refuses_hostile_input(text, why):
  with pytest.raises(CalculatorError, match=why):
    calculate(text)


def test_answers_match():
  assert answers_match("42", ["42"]) and answers_match("4 2", ["42"])
  assert answers_match("42.0", ["42"])
  assert answers_match("1/2", ["0.5"]) and not answers_match("41", ["42"])
  assert not answers_match(None, ["1"]) and not answers_match("", ["1"])
  assert not answers_match("9" * 100, ["9"])  # over-long: wrong without parsing
  assert not answers_match("((((((((((", ["1"]) and not answers_match("\\frac{", ["1"])


def test_env_under_hostile_outputs():
  env = make_math_env(max_turns=3)
  assert isinstance(env, ToolEnv)
  s = env.reset({"answers": ["30"], "id": "p"})
  step = lambda text: env.step_batch([s], [text])[0]  # noqa: E731
  r = step("<think> x </think> <calculate> 4 0 * ( 100 - 25 ) / 100 </calculate>")
  assert r.observation_text == "<result> 30 </result>" and not r.done
  r = step("<calculate> 1 + ")  # unclosed
  assert "error : unclosed tag" in r.observation_text and not r.done
  r = step("<answer> 30 </answer>")
  assert r.done and r.reward == 1.0
  s = env.reset({"answers": ["30"]})
  for text, want in (("no action at all", "no <calculate>"),
                     ("<calculate> import os </calculate>", "not an arithmetic")):
    assert want in env.step_batch([s], [text])[0].observation_text
  r = env.step_batch([s], ["<calculate> " + "9" * 30 + " </calculate>"])[0]
  assert r.done and r.reward == 0.0 and r.info["turn_limit"]  # the third action: no turn left
  s = env.reset({"answers": ["30"]})
  r = env.step_batch([s], ["<answer> 30 </answer> <calculate> 1 </calculate>"])[0]
  assert r.done and r.reward == 1.0  # the first action counts
  with pytest.raises(ValueError, match="no 'answers'"):
    env.reset({"id": "q"})


def test_generator_expert_and_tokenizer(tmp_path):
  w = generate_math_world(MathWorldConfig(n_train=600, n_test=100))
  assert len(w.train) == 600 and len(w.test) == 100
  assert not {p.question for p in w.test} & {p.question for p in w.train}
  assert generate_math_world(MathWorldConfig(n_train=600, n_test=100)).train[5] == w.train[5]
  rng = np.random.default_rng(0)
  assert all(expert_segments(w, p, rng, oracle=True)[1] for p in w.test)  # the oracle solves all
  ok = {}
  for p in w.train:
    ok.setdefault(p.template, []).append(expert_segments(w, p, rng)[1])
  for t, v in ok.items():  # the planted mistake at the template's rate (4 sigma)
    rate = w.expert_rates[t]
    assert abs(np.mean(v) - rate) < 4 * np.sqrt(rate * (1 - rate) / len(v)) + 0.01, t
  # The expert's turns replay in the environment with the same results, through the tokenizer.
  tok = build_math_tokenizer(w)
  env = make_math_env()
  for p in w.test[:20]:
    segs, _ = expert_segments(w, p, rng, oracle=True)
    s = env.reset({"answers": p.answers})
    for (text, gen), nxt in zip(segs[1:], segs[2:] + [(None, False)]):
      if not gen:
        continue
      assert tok.token_to_id("<unk>") not in tok.encode(text).ids
      r = env.step_batch([s], [tok.decode(tok.encode(text).ids)])[0]
      assert (r.observation_text or None) == (nxt[0] if nxt[0] and not nxt[1] else None)
    assert r.done and r.reward == 1.0
  w.save(str(tmp_path))
  assert MathWorld.load(str(tmp_path)).train == w.train


def test_real_data_reader(tmp_path):
  assert final_answer("so 3 + 4 = 7\n#### 1,007") == "1007"
  assert final_answer("hence $\\boxed{\\frac{1}{2}}$") == "\\frac{1}{2}"
  p = tmp_path / "gsm.jsonl"
  p.write_text("\n".join(json.dumps(r) for r in [
      {"question": "2+2?", "answer": "2+2=4\n#### 4"},
      {"problem": "half?", "solution": "it is \\boxed{\\frac{1}{2}}", "id": "m1"}]) + "\n")
  probs = read_math_jsonl(str(p))
  assert [x.answers for x in probs] == [["4"], ["\\frac{1}{2}"]] and probs[1].id == "m1"
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"question": "q", "answer": "' + "x" * 100 + '"}\n')
  with pytest.raises(ValueError, match="no final answer"):
    read_math_jsonl(str(bad))
  bad.write_text("{not json\n")
  with pytest.raises(ValueError, match="invalid JSON"):
    read_math_jsonl(str(bad))
  assert squash_digits("4 0 . 5 + 1 2") == "40.5 + 12"


def test_math_main_job_smoke(tmp_path):
  """`launch/train.py --config=configs/tool_math.py:smoke`, one step: warm start on the expert's
  traces, a trace_tree step through the calculator, held-out EM per template."""
  from test_train_smoke import tool_task_smoke

  summary, evals = tool_task_smoke(tmp_path, "configs/tool_math.py:smoke")
  assert summary["rollouts"] > 0 and summary["warm_start"]["rows"] > 0
  assert evals and any(k.startswith("eval_em_group/") for k in evals[0])
