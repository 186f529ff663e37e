"""`launch/train.py` as two JAX processes on 127.0.0.1 (4 CPU devices each, one global mesh of 8):
the smoke run of `tests/test_train_smoke.py` for 2 RL steps, with process 1's first environment
step stalled past gloo's 30 s window. (A resume of both processes, and a tool failure on one of
them, are tested on the real-checkpoint path: `tests/test_real_path.py`.)

Each process samples its share of every step's requests on its own 4 devices and sees every tree;
the update runs on the global (data 2, fsdp 2, tensor 2) mesh; only process 0 writes the run's
files; both write the checkpoints together.
"""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from test_train_smoke import PREFIX_BUDGET, ROOT, ROOT_BUDGET, launch_env, smoke_args

MESH = "data:2,fsdp:2,tensor:2"
STALL_S = 35


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch_pair(base, args, process1_args=(), timeout=900, name="pair"):
  """Runs both processes of one `launch/train.py` command (process 1 with `process1_args` too);
  returns their outputs. Kills both when either fails or the pair runs past `timeout` seconds."""
  port = _free_port()
  procs, logs = [], []
  for i in range(2):
    env = dict(launch_env(devices=4), TRACE_JAX_COORDINATOR=f"127.0.0.1:{port}",
               TRACE_JAX_NUM_PROCESSES="2", TRACE_JAX_PROCESS_ID=str(i),
               TRACE_JAX_INIT_TIMEOUT="120", TRACE_JAX_HEARTBEAT_TIMEOUT="60",
               TRACE_JAX_GATHER_TIMEOUT="300", TRACE_JAX_SHUTDOWN_TIMEOUT="60")
    log = open(os.path.join(base, f"{name}-process{i}.log"), "w+")
    logs.append(log)
    extra = list(process1_args) if i == 1 else []
    # A process given fault flags runs the training main through tests/faults.py.
    script = os.path.join(ROOT, "tests", "faults.py") if extra else \
        os.path.join(ROOT, "launch", "train.py")
    procs.append(subprocess.Popen(
        [sys.executable, script, *args, *extra], cwd=ROOT,
        env=env, stdout=log, stderr=subprocess.STDOUT))
  deadline = time.time() + timeout
  try:
    while any(p.poll() is None for p in procs):
      failed = [p for p in procs if p.poll() not in (None, 0)]
      if failed or time.time() > deadline:
        break
      time.sleep(1)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait(timeout=30)
  outs = []
  for log in logs:
    log.seek(0)
    outs.append(log.read())
    log.close()
  for i, p in enumerate(procs):
    assert p.returncode == 0, f"process {i} exited {p.returncode}:\n" + outs[i][-4000:]
  return outs


def _smoke_pair_args(base, steps):
  # Each process pads its pool to whole trees per shard: 2 pool shards per process on this mesh.
  return smoke_args(base, steps) + [f"--config.mesh={MESH}", "--config.rollout.num_pages=512"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  base = str(tmp_path_factory.mktemp("multiprocess"))
  t0 = time.time()
  # Process 1's first tool call hangs for 35 s: process 0 waits for it at the next gather.
  first = launch_pair(base, _smoke_pair_args(base, 2), [f"--stall=1:{STALL_S}"],
                      name="steps2")
  print(f"two-process smoke run {time.time() - t0:.0f}s")
  return dict(base=base, workdir=os.path.join(base, "run"), first=first,
              summary2=json.load(open(os.path.join(base, "run", "summary.json"))))


@pytest.mark.slow
def test_two_processes_train_the_global_step(pair):
  s = pair["summary2"]
  assert s["steps"] == 2 and s["method"] == "trace_tree"
  # every process sampled part of each step: the summary counts the whole step's budget
  assert s["rollouts"] == 2 * (ROOT_BUDGET + PREFIX_BUDGET)
  assert s["generated_tokens"] > 0 and 0.0 <= s["effective_ratio"] <= 1.0
  w = pair["workdir"]
  assert "2" in set(os.listdir(os.path.join(w, "checkpoints")))  # written together
  recs = [json.loads(line) for line in open(os.path.join(w, "metrics.jsonl"))]
  rl = [r for r in recs if "effective_ratio" in r]
  # one writer: each RL step recorded once, with the rollouts of the whole (global) step
  assert [r["step"] for r in rl] == [1, 2]
  assert [r["rollouts_total"] for r in rl] == [(ROOT_BUDGET + PREFIX_BUDGET) * k for k in (1, 2)]
  assert all(r["finite"] == 1.0 for r in rl)
  # the stalled process held the other one up without breaking the run: both exited 0 having built
  # the same steps (the loop checks that each step's record agrees across processes)
  assert "injected stall" in pair["first"][1] and "injected stall" not in pair["first"][0]
  # only process 0 prints the summary
  assert "rollouts" in pair["first"][0].split("[trace_jax] step 2")[-1]
  assert "slot_utilization" not in pair["first"][1]
