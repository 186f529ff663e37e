"""End to end: `launch/train.py --config=configs/mhqa.py:smoke` at the smallest size, then a resume.

The run (about a minute of compilation and sampling on 2 cores) is made once per session by
`smoke_run`; `tests/test_eval_launch.py` evaluates the same run's checkpoint.
"""

import fcntl
import glob
import json
import os
import subprocess
import sys
import time

import pytest

# Launched runs share the tests' persistent compilation cache: a resumed run compiles nothing again.
from conftest import COMPILE_CACHE, xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT_BUDGET, PREFIX_BUDGET = 4, 2
SUMMARY_KEYS = ("accuracy_start", "accuracy_final", "effective_ratio", "generated_tokens",
                "rollouts", "wall_seconds", "method", "seed")


def launch_env(devices: int = 1) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
             JAX_COMPILATION_CACHE_DIR=COMPILE_CACHE,
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
  if devices > 1:
    env["XLA_FLAGS"] = xla_flags(devices)
  return env


def launch(script, *args, timeout=600, devices=1):
  """Runs a launch script (a name in launch/, or a path from the repository root such as
  tests/faults.py); returns the CompletedProcess (stdout and stderr joined)."""
  path = os.path.join(ROOT, script) if "/" in script else os.path.join(ROOT, "launch", script)
  return subprocess.run([sys.executable, path, *args], cwd=ROOT,
                        env=launch_env(devices), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        text=True, timeout=timeout)


def smoke_args(base, steps):
  """The smoke variant shrunk further: few traces and prompts, tiny budgets, small eval."""
  return ["--config=configs/mhqa.py:smoke", f"--workdir={base}/run",
          f"--config.world.cache_dir={base}/cache", f"--config.rl.steps={steps}",
          "--config.sft.steps=3", "--config.sft.num_traces=64",
          "--config.rollout.prompts_per_step=2", f"--config.rollout.root_budget={ROOT_BUDGET}",
          f"--config.rollout.prefix_budget={PREFIX_BUDGET}", "--config.rollout.num_slots=4",
          "--config.rollout.num_pages=256", "--config.eval.size=4",
          "--config.eval.probe_prompts=2"]


def smoke_config(tmp_path_factory, workdir, method="trace_tree", **sections):
  """The smoke run's config as a typed `TrainConfig` (its warm start reused from the session's
  smoke cache), one RL step, `method`, and `sections` overrides written section__field=value."""
  from configs import mhqa

  base = os.path.dirname(smoke_run(tmp_path_factory)["cache"])
  c = mhqa.get_config("smoke")
  for arg in smoke_args(base, 1)[1:]:
    key, value = arg[2:].split("=", 1)
    if key == "workdir":
      continue
    *path, last = key.split(".")[1:]
    target = c
    for k in path:
      target = target[k]
    target[last] = type(target[last])(value)
  c.method, c.workdir, c.rl.steps = method, str(workdir), 1
  for dotted, value in sections.items():
    sec, key = dotted.split("__")
    c[sec][key] = value
  return mhqa.validate(c)


def tool_task_smoke(tmp_path, config: str):
  """One trace_tree step of a tool task's main job at the smallest size (`config`, e.g.
  configs/tool_math.py:smoke); returns (summary, evaluation records)."""
  res = launch("train.py", f"--config={config}", f"--workdir={tmp_path}/run",
               f"--config.world.cache_dir={tmp_path}/cache", "--config.rl.steps=1",
               "--config.sft.steps=3", "--config.sft.num_traces=64",
               "--config.rollout.prompts_per_step=2", "--config.rollout.root_budget=4",
               "--config.rollout.prefix_budget=2", "--config.rollout.num_slots=4",
               "--config.rollout.num_pages=512", "--config.eval.size=4",
               "--config.eval.probe_prompts=2")
  assert res.returncode == 0, res.stdout[-3000:]
  summary = json.loads((tmp_path / "run" / "summary.json").read_text())
  evals = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")
           if '"eval_em"' in line]
  return summary, evals


def draw_outcomes(trees, seed: int = 0) -> None:
  """Leaf rewards drawn at random (the smoke policy rarely succeeds, which makes every advantage,
  and the policy gradient, zero)."""
  import numpy as np

  rng = np.random.default_rng(seed)
  for t in trees:
    for leaf in t.leaves():
      leaf.reward = float(rng.random() < 0.5)


_RUNS = {}


def smoke_run(tmp_path_factory) -> dict:
  """Trains 2 steps, then resumes to 3 in the same workdir, once per test session, also when the
  suite runs on several workers: the first worker to ask trains it under a lock in the session's
  shared temporary directory, the others wait and read it. Returns paths, outputs and both
  summaries."""
  if "run" in _RUNS:
    return _RUNS["run"]
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent  # the workers' directories share this parent
  base = os.path.join(str(root), "smoke_shared")
  os.makedirs(base, exist_ok=True)
  with open(os.path.join(base, ".lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    done = os.path.join(base, "smoke_run.json")
    if os.path.exists(done):
      _RUNS["run"] = json.load(open(done))
    else:
      _train_smoke_run(base)
      with open(done, "w") as f:
        json.dump(_RUNS["run"], f)
  return _RUNS["run"]


def _train_smoke_run(base):
  t0 = time.time()
  first = launch("train.py", *smoke_args(base, 2))
  assert first.returncode == 0, first.stdout[-4000:]
  summary2 = json.load(open(os.path.join(base, "run", "summary.json")))
  # What a kill -9 between a step's metrics and its checkpoint leaves: a record of a step that
  # no checkpoint holds, and a torn last line. The resume drops both.
  with open(os.path.join(base, "run", "metrics.jsonl"), "a") as f:
    f.write(json.dumps({"step": 3, "effective_ratio": 0.5}) + "\n" + '{"step": 3, "eff')
  t1 = time.time()
  second = launch("train.py", *smoke_args(base, 3))
  assert second.returncode == 0, second.stdout[-4000:]
  _RUNS["run"] = dict(workdir=os.path.join(base, "run"), cache=os.path.join(base, "cache"),
                      first=first.stdout, second=second.stdout, summary2=summary2,
                      summary3=json.load(open(os.path.join(base, "run", "summary.json"))),
                      seconds=(t1 - t0, time.time() - t1))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  return smoke_run(tmp_path_factory)


@pytest.mark.slow
def test_smoke_run_summary_and_outputs(run):
  s = run["summary2"]
  assert all(k in s for k in SUMMARY_KEYS), sorted(s)
  assert s["method"] == "trace_tree" and s["seed"] == 0 and s["steps"] == 2
  assert s["rollouts"] == 2 * (ROOT_BUDGET + PREFIX_BUDGET)
  for k in ("accuracy_start", "accuracy_final", "effective_ratio"):
    assert 0.0 <= s[k] <= 1.0, (k, s[k])
  assert s["generated_tokens"] > 0 and s["wall_seconds"] > 0
  # Provenance: the machine and packages, and the warm start's fingerprints (trained here; the
  # resumed run restores it from the cache, the same parameters)
  assert s["environment"]["packages"]["jax"] and s["environment"]["cpu_count"] >= 1
  ws, ws3 = s["warm_start"], run["summary3"]["warm_start"]
  assert not ws["cached"] and len(ws["params_sha1"]) == 12 and len(ws["data_sha1"]) == 12
  assert ws3["cached"] and ws3["params_sha1"] == ws["params_sha1"]
  assert ws3["data_sha1"] == ws["data_sha1"]  # kept in the cache's metadata
  w = run["workdir"]
  for name in ("config.json", "metrics.jsonl", "training_curves.png"):
    assert os.path.getsize(os.path.join(w, name)) > 0, name
  assert all(os.path.exists(p) for p in s["plots"]) and s["plots"]
  assert glob.glob(os.path.join(w, "tb", "events.out.tfevents.*"))
  recs = [json.loads(line) for line in open(os.path.join(w, "metrics.jsonl"))]
  steps = {r["step"] for r in recs}
  assert {0, 1, 2, 3} <= steps  # eval before RL, two steps, and the resumed third
  assert os.path.isdir(os.path.join(w, "checkpoints"))


@pytest.mark.slow
def test_smoke_run_resumes(run):
  assert "resumed at step 2" in run["second"], run["second"][-3000:]
  assert "resumed" not in run["first"]
  s = run["summary3"]
  assert s["steps"] == 3 and s["rollouts"] == 3 * (ROOT_BUDGET + PREFIX_BUDGET)
  assert s["generated_tokens"] > run["summary2"]["generated_tokens"]
  assert s["warm_start"].get("cached") is True  # the warm start is not trained again
  # the wall clock of the whole run, both processes (the second alone took less than this)
  assert run["seconds"][1] < s["wall_seconds"] <= sum(run["seconds"])
  recs = [json.loads(line) for line in open(os.path.join(run["workdir"], "metrics.jsonl"))]
  rl_steps = [r["step"] for r in recs if "effective_ratio" in r]
  assert rl_steps == [1, 2, 3]  # one more step, none repeated
  assert s["evals"].keys() >= {"0", "2", "3"}


def test_paper_variant_without_paths_fails_fast(tmp_path):
  t0 = time.time()
  p = launch("train.py", "--config=configs/mhqa.py:qwen3_14b", f"--workdir={tmp_path}/run",
             timeout=120)
  assert p.returncode != 0
  assert "--config.model.path" in p.stdout, p.stdout[-2000:]
  assert time.time() - t0 < 60  # nothing was built or compiled
  assert not os.path.exists(os.path.join(tmp_path, "run"))


def test_unknown_config_key_fails(tmp_path):
  p = launch("train.py", "--config=configs/mhqa.py:smoke", f"--workdir={tmp_path}/run",
             "--config.rl.no_such_key=3", timeout=120)
  assert p.returncode != 0
  assert "no_such_key" in p.stdout, p.stdout[-2000:]
  assert not os.path.exists(os.path.join(tmp_path, "run"))


def test_rollouts_ahead_stop_before_evaluations_and_checkpoints():
  """`rollout.off_policy_steps=1`: a step followed by an evaluation, a checkpoint or the run's
  end starts nothing ahead (`train.drains`); the setting takes 0 or 1 and one process."""
  from configs import mhqa
  from trace_jax.train import drains

  c = mhqa.get_config("smoke")
  c.rl.steps, c.eval.every, c.ckpt.every, c.rollout.off_policy_steps = 10, 4, 6, 1
  tc = mhqa.validate(c)
  assert [s for s in range(10) if drains(tc, s)] == [3, 5, 7, 9]
  c.rollout.off_policy_steps = 2
  with pytest.raises(ValueError, match="off_policy_steps"):
    mhqa.validate(c)
