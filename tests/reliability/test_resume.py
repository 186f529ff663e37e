"""Exact resume, preemption and divergence, end to end through `launch/train.py` (smoke size).

- A run stopped after step 2 and resumed to 3 (the smoke run of tests/test_train_smoke.py, with a
  duplicate record and a torn line planted in its metrics before the resume, as a `kill -9` between
  a step's metrics and its checkpoint leaves them) equals an uninterrupted 3-step run: the same
  metric records and bit-identical parameters and predictor.
- With rollouts one step ahead (`rollout.off_policy_steps=1`) a run preempted with rollouts in
  flight resumes from its last checkpoint and equals an uninterrupted one too, and each step's
  ledger holds its own budget.
- SIGTERM on 8 simulated devices: the run checkpoints its step, exits 75, and the rerun resumes on
  the same multi-device host and finishes with each step recorded once.
- lr=nan fails at the config's translation, before anything is built; a NaN loss on every update
  (tests/faults.py) stops with exit 70 and no checkpoint of a bad state. (At smoke size every group
  is unmixed, advantages are zero and no learning rate moves the policy, so exploding parameters,
  lr=1e30, are tested on `check_divergence` directly.)
"""

import json
import os
import signal
import subprocess
import sys
import time
import types

import numpy as np
import orbax.checkpoint as ocp
import pytest

from test_train_smoke import (PREFIX_BUDGET, ROOT, ROOT_BUDGET, launch, launch_env, smoke_args,
                              smoke_run)

TIMING = ("seconds", "wall")


def records(workdir):
  """RL and eval records without wall-clock timings, in file order."""
  out = []
  for line in open(os.path.join(workdir, "metrics.jsonl")):
    r = json.loads(line)
    if r["step"] >= 0:
      out.append({k: v for k, v in r.items() if not any(t in k for t in TIMING)})
  return out


def state_arrays(workdir, step):
  path = os.path.join(workdir, "checkpoints", str(step), "state")
  tree = ocp.StandardCheckpointer().restore(path)
  import jax
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def args_in(run, workdir, steps, *extra):
  """The smoke run's arguments (same world and warm-start cache) with another workdir."""
  base = os.path.dirname(run["workdir"])
  return [*smoke_args(base, steps), f"--workdir={workdir}", *extra]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  return smoke_run(tmp_path_factory)


@pytest.mark.slow
def test_resumed_run_equals_uninterrupted_run(run, tmp_path):
  whole = str(tmp_path / "whole")
  p = launch("train.py", *args_in(run, whole, 3))
  assert p.returncode == 0, p.stdout[-3000:]
  assert "resumed at step" not in p.stdout
  # The smoke run was stopped after step 2 with a record of step 3 and a torn line planted in its
  # metrics (tests/test_train_smoke.py); its resume dropped both.
  assert "metric records after it dropped" in run["second"], run["second"][-2000:]
  assert records(run["workdir"]) == records(whole)
  a, b = state_arrays(run["workdir"], 3), state_arrays(whole, 3)
  assert len(a) == len(b) and all(x.dtype == y.dtype and np.array_equal(x, y)
                                  for x, y in zip(a, b))
  s_res = json.load(open(os.path.join(run["workdir"], "summary.json")))
  s_whole = json.load(open(os.path.join(whole, "summary.json")))
  for k in ("accuracy_final", "effective_ratio", "generated_tokens", "rollouts", "prefill_tokens",
            "tool_calls", "predictor", "slot_utilization"):
    assert s_res[k] == s_whole[k], k


@pytest.mark.slow
def test_off_policy_run_resumes_exactly_and_keeps_its_budget(run, tmp_path):
  """Rollouts one step ahead (`rollout.off_policy_steps=1`, streamed stage 2): steps 0 and 2
  start the next step's stage-1 rollouts in their tails, steps 1 and 3 (followed by an evaluation
  and a checkpoint) do not. A run preempted (SIGTERM) during step 2, with step 3's rollouts in
  flight, saves nothing over its step-2 checkpoint (it would not hold them), drops them, exits
  75; resumed, it equals an uninterrupted 4-step run, record for record and bit for bit. Every
  step's ledger holds its own budget, and the adopted steps record how many of their tokens the
  previous weights generated."""
  extra = ("--config.rollout.off_policy_steps=1", "--config.rollout.stage2=stream",
           "--config.eval.every=2", "--config.ckpt.every=2")
  whole, part = str(tmp_path / "whole"), str(tmp_path / "part")
  p = launch("train.py", *args_in(run, whole, 4, *extra))
  assert p.returncode == 0, p.stdout[-3000:]
  p = launch("tests/faults.py", *args_in(run, part, 4, *extra, "--sigterm_step=2"))
  assert p.returncode == 75, p.stdout[-3000:]
  assert "SIGTERM" in p.stdout and "checkpointed step 2" in p.stdout, p.stdout[-3000:]
  ckpts = sorted(int(s) for s in os.listdir(os.path.join(part, "checkpoints")) if s.isdigit())
  assert ckpts == [2], ckpts
  p = launch("train.py", *args_in(run, part, 4, *extra))
  assert p.returncode == 0, p.stdout[-3000:]
  assert "resumed at step 2" in p.stdout
  recs = records(whole)
  assert records(part) == recs
  a, b = state_arrays(part, 4), state_arrays(whole, 4)
  assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
  rl = {r["step"]: r for r in recs if "effective_ratio" in r}
  assert sorted(rl) == [1, 2, 3, 4]
  assert all(r["ledger_rollouts_started"] == ROOT_BUDGET + PREFIX_BUDGET for r in rl.values())
  assert rl[1]["ahead_rollouts"] > 0 and rl[3]["ahead_rollouts"] > 0  # steps 0 and 2
  assert rl[2]["ahead_rollouts"] == 0 == rl[4]["ahead_rollouts"]
  assert 0 < rl[2]["staleness"] < 1 and 0 < rl[4]["staleness"] < 1


@pytest.mark.slow
def test_sigterm_checkpoints_and_resumes_on_8_devices(run, tmp_path):
  work = str(tmp_path / "preempted")
  # The KV pool's slots and pages split over 8 shards; a tree lives on one shard, so each shard's
  # pages must hold a whole tree (the probe's 8 rollouts of max_seq_len: 192 of 256 pages).
  eight = ("--config.rollout.num_slots=8", "--config.rollout.num_pages=2048")
  cmd = [sys.executable, os.path.join(ROOT, "launch", "train.py"), *args_in(run, work, 3, *eight)]
  proc = subprocess.Popen(cmd, cwd=ROOT, env=launch_env(devices=8), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  metrics = os.path.join(work, "metrics.jsonl")
  deadline = time.time() + 400
  while time.time() < deadline and proc.poll() is None:
    if os.path.exists(metrics) and any('"effective_ratio"' in line for line in open(metrics)):
      proc.send_signal(signal.SIGTERM)
      break
    time.sleep(0.2)
  out, _ = proc.communicate(timeout=400)
  assert proc.returncode == 75, out[-3000:]
  assert "SIGTERM" in out and "checkpointed step" in out, out[-3000:]
  steps = [int(s) for s in os.listdir(os.path.join(work, "checkpoints")) if s.isdigit()]
  assert steps and max(steps) in (1, 2)
  again = launch("train.py", *args_in(run, work, 3, *eight), devices=8)
  assert again.returncode == 0, again.stdout[-3000:]
  assert f"resumed at step {max(steps)}" in again.stdout
  rl = [r["step"] for r in records(work) if "effective_ratio" in r]
  assert rl == [1, 2, 3]
  summary = json.load(open(os.path.join(work, "summary.json")))
  assert summary["rollouts"] == run["summary3"]["rollouts"]


def test_nan_lr_fails_before_anything_is_built(run, tmp_path):
  work = str(tmp_path / "lr_nan")
  p = launch("train.py", *args_in(run, work, 3, "--config.rl.lr=nan"), timeout=120)
  assert p.returncode == 1 and "rl.lr=nan must be a finite number" in p.stdout, p.stdout[-3000:]
  assert not os.path.exists(work)


@pytest.mark.slow
def test_nan_loss_stops_with_exit_70(run, tmp_path):
  work = str(tmp_path / "nan_loss")
  # A NaN loss at step 1 (tests/faults.py) and max_consecutive_skips=1: one skipped update stops.
  p = launch("tests/faults.py", *args_in(run, work, 3, "--nan_steps=1",
                                         "--config.rl.max_consecutive_skips=1"))
  assert p.returncode == 70, p.stdout[-3000:]
  assert "training diverged at RL step" in p.stdout, p.stdout[-3000:]
  assert not os.path.exists(os.path.join(work, "summary.json"))
  ckpts = os.path.join(work, "checkpoints")
  for s in (os.listdir(ckpts) if os.path.isdir(ckpts) else []):
    if s.isdigit():  # whatever was checkpointed is finite
      assert all(np.isfinite(x).all() for x in state_arrays(work, int(s))
                 if np.issubdtype(x.dtype, np.floating))


@pytest.mark.slow
def test_injected_nan_step_is_skipped_and_the_run_goes_on(run, tmp_path):
  # A NaN loss at RL step 1 (the fault `benchmarks/chaos.py` injects): the update is skipped, the
  # parameters and optimizer state after it are bit-identical to those before it, the run finishes.
  work = str(tmp_path / "nan_step")
  p = launch("tests/faults.py", *args_in(run, work, 2, "--nan_steps=1"))
  assert p.returncode == 0, p.stdout[-3000:]
  rl = {r["step"]: r for r in records(work) if "effective_ratio" in r}
  # Every optimizer update of the step (PPO epochs x minibatches) saw the NaN and was skipped;
  # one bad step is one RL step's worth of skips, under the divergence limit.
  n = int(rl[2]["optimizer_steps"])
  assert rl[1]["finite"] == 1.0 and rl[2]["finite"] == 0.0 and rl[2]["skipped_steps"] == n
  import jax
  restore = lambda s: ocp.StandardCheckpointer().restore(  # noqa: E731
      os.path.join(work, "checkpoints", str(s), "state"))
  before, after = restore(1), restore(2)
  for key in ("params", "opt"):  # the policy and its optimizer did not move (the predictor's own
    a, b = jax.tree.leaves(before[key]), jax.tree.leaves(after[key])  # fit runs before the update)
    assert len(a) == len(b) > 0 and all(np.array_equal(x, y) for x, y in zip(a, b))
  assert int(after["skipped"]) == int(before["skipped"]) + n == n
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(after)
             if np.issubdtype(np.asarray(x).dtype, np.floating))


def _stub(tmp_path, **rl):
  import ml_collections
  from trace_jax.checkpoint import Checkpointer
  c = ml_collections.ConfigDict(dict(
      rl=dict(max_consecutive_skips=3, max_param_growth=100.0, ppo_epochs=1, minibatches=1, **rl),
      eval=dict(stop_on_collapse=True)))
  return types.SimpleNamespace(c=c, init_param_norm=10.0,
                               ckpt=Checkpointer(str(tmp_path / "ck")))


@pytest.mark.parametrize("rec, streak, evals, why", [
    ({"param_norm": 3e30}, 0, {}, "parameter norm reached 3e+30"),
    ({"param_norm": float("nan")}, 0, {}, "parameter norm reached nan"),
    ({"param_norm": 12.0}, 3, {}, "3 consecutive updates"),
    ({"param_norm": 12.0, "eval_em": 0.0}, 0, {"0": 0.25, "4": 0.0}, "collapsed from 0.250"),
])
def test_check_divergence_reasons(tmp_path, rec, streak, evals, why):
  from trace_jax.train import Diverged, LoopState, check_divergence
  state = LoopState(train={"skip_streak": np.int32(streak)}, step=4, evals=evals)
  with pytest.raises(Diverged, match="no checkpoint was written") as e:
    check_divergence(_stub(tmp_path), state, rec)
  assert why in str(e.value)


def test_check_divergence_passes_healthy_steps(tmp_path):
  # just under each limit passes (norm 10 x max_param_growth 100 = 1000; 2 of 3 skips; EM at 0
  # from 0 is no collapse); just over the norm's does not
  from trace_jax.train import Diverged, LoopState, check_divergence
  state = LoopState(train={"skip_streak": np.int32(2)}, step=4, evals={"0": 0.0, "4": 0.0})
  check_divergence(_stub(tmp_path), state, {"param_norm": 999.0, "eval_em": 0.0})
  with pytest.raises(Diverged, match="parameter norm reached 1001"):
    check_divergence(_stub(tmp_path), state, {"param_norm": 1001.0, "eval_em": 0.0})


def test_garbled_reply_is_retried():
  """A 200 answer with a torn JSON body (a flaky server or proxy) is retried like a 5xx; the chaos
  campaign found it ended the search with an error observation instead."""
  import http.server
  import threading

  from trace_jax.envs.retrieval.http_client import HTTPRetriever
  calls = []

  class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
      pass

    def do_POST(self):  # noqa: N802
      self.rfile.read(int(self.headers.get("Content-Length", 0)))
      calls.append(1)
      body = (b'{"result": [[{"contents": ' if len(calls) == 1 else
              json.dumps({"result": [[{"id": "1", "contents": "T\nx"}]]}).encode())
      self.send_response(200)
      self.send_header("Content-Length", str(len(body)))
      self.end_headers()
      self.wfile.write(body)

  srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
  threading.Thread(target=srv.serve_forever, daemon=True).start()
  try:
    client = HTTPRetriever(f"http://127.0.0.1:{srv.server_address[1]}", max_retries=2,
                           backoff_s=0.01)
    docs = client.search(["q"], 1)
  finally:
    srv.shutdown()
  assert len(calls) == 2 and docs[0][0].text == "x"
