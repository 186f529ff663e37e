"""A randomized fault campaign against the training loop (smoke size, real local retrieval server).

  python benchmarks/chaos.py --faults=30 --out=results/chaos.json

First an uninterrupted reference run. Then trials: each starts a fresh run of the same config and
injects faults while it trains: SIGTERM or kill -9 of the trainer at a random moment (which often
falls inside a checkpoint write), and retrieval faults through a fault-injecting proxy between the
trainer and the server (a stall past the client's timeout, HTTP 500s, malformed replies, dropped
connections, the server killed and restarted). After a process fault the trial reruns the same
command, as a scheduler would, until the run finishes. Every finished run must equal the reference:
the same RL and eval records (timings and retriever counters aside: faults cost retries) and
bit-identical final parameters. A `nan` fault gives one random RL step a NaN loss
(`tests/faults.py --nan_steps`): that trial's reference is an uninterrupted run with the same
NaN, and the
trial must also show the step skipped (recorded, counted once) and every saved array finite.
Writes every fault tried and its outcome to `--out`.
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
RETRIEVER_FAULTS = ("stall", "http500", "malformed", "drop", "server_restart")
PROCESS_FAULTS = ("sigterm", "kill9")
STATE_FAULTS = ("nan",)  # a NaN loss at a random RL step (`tests/faults.py --nan_steps`)
IGNORED = ("seconds", "wall", "retriever_")


class FaultProxy:
  """HTTP proxy to the retrieval server that fails the next requests as told (`arm`)."""

  def __init__(self, upstream_port: int, stall_s: float):
    self.upstream, self.stall_s = upstream_port, stall_s
    self.pending: list[str] = []
    self.injected: list[str] = []
    self.lock = threading.Lock()
    proxy = self

    class Handler(http.server.BaseHTTPRequestHandler):
      def log_message(self, *a):
        pass

      def _forward(self, method):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
        fault = None
        with proxy.lock:
          if method == "POST" and proxy.pending:
            fault = proxy.pending.pop(0)
            proxy.injected.append(fault)
        if fault == "stall":
          time.sleep(proxy.stall_s)
          self.close_connection = True
          return
        if fault == "drop":
          self.close_connection = True
          return
        if fault in ("http500", "malformed"):
          data = b"internal error" if fault == "http500" else b'{"result": [[{"contents": '
          self.send_response(500 if fault == "http500" else 200)
          self.send_header("Content-Type", "application/json")
          self.send_header("Content-Length", str(len(data)))
          self.end_headers()
          self.wfile.write(data)
          return
        try:
          conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream, timeout=30)
          conn.request(method, self.path, body=body or None,
                       headers={"Content-Type": "application/json"})
          resp = conn.getresponse()
          data = resp.read()
        except OSError:
          self.send_response(503)
          self.send_header("Content-Length", "0")
          self.end_headers()
          return
        self.send_response(resp.status)
        self.send_header("Content-Type", resp.getheader("Content-Type", "application/json"))
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

      def do_POST(self):  # noqa: N802
        self._forward("POST")

      def do_GET(self):  # noqa: N802
        self._forward("GET")

    self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.server.daemon_threads = True
    self.port = self.server.server_address[1]
    threading.Thread(target=self.server.serve_forever, daemon=True).start()

  def arm(self, fault: str):
    with self.lock:
      self.pending.append(fault)

  def close(self):
    self.server.shutdown()


def start_server(world_dir: str, port: int = 0):
  p = subprocess.Popen([sys.executable, os.path.join(ROOT, "launch", "retrieval_server.py"),
                        "--world", world_dir, "--port", str(port), "--log_level", "WARNING"],
                       cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  line = p.stdout.readline()
  if "http://" not in line:
    raise RuntimeError(f"retrieval server did not start: {line!r}")
  return p, int(line.strip().rsplit(":", 1)[1].split("/")[0])


def env(cache):
  return dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
              JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
              JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")


def run_args(a, workdir, port):
  # tests/faults.py is launch/train.py with fault flags (--nan_steps) through the run's hooks.
  return [sys.executable, os.path.join(ROOT, "tests", "faults.py"),
          "--config=configs/mhqa.py:smoke", f"--workdir={workdir}",
          f"--config.world.cache_dir={a.cache}", f"--config.rl.steps={a.steps}",
          f"--config.sft.steps={a.sft_steps}", f"--config.sft.num_traces={a.sft_traces}",
          "--config.retriever.kind=http", f"--config.retriever.url=http://127.0.0.1:{port}",
          f"--config.retriever.timeout_s={a.timeout}", "--config.retriever.retries=6",
          "--config.retriever.backoff_s=0.5", "--config.eval.size=8",
          "--config.eval.every=2", "--config.ckpt.every=1"]


def records(workdir):
  out = []
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      r = json.loads(line)
      if r["step"] >= 0:
        out.append({k: v for k, v in r.items() if not any(t in k for t in IGNORED)})
  return out


def final_arrays(workdir, step):
  import jax
  import orbax.checkpoint as ocp
  tree = ocp.StandardCheckpointer().restore(
      os.path.join(os.path.abspath(workdir), "checkpoints", str(step), "state"))
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def same_state(a_dir, b_dir, step):
  a, b = final_arrays(a_dir, step), final_arrays(b_dir, step)
  return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--faults", type=int, default=30, help="faults to inject in all")
  ap.add_argument("--per_trial", type=int, default=3, help="faults per trial run")
  ap.add_argument("--steps", type=int, default=4)
  ap.add_argument("--sft_steps", type=int, default=60)
  ap.add_argument("--sft_traces", type=int, default=1500)
  ap.add_argument("--timeout", type=float, default=2.0, help="retriever timeout (s) of the runs")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--work", default="", help="scratch directory (default: a temporary one)")
  ap.add_argument("--cache", default="cache/chaos", help="world and warm-start cache")
  ap.add_argument("--out", default="results/chaos.json")
  ap.add_argument("--kinds", default=",".join(PROCESS_FAULTS + RETRIEVER_FAULTS + STATE_FAULTS),
                  help="fault kinds to draw from")
  a = ap.parse_args()
  kinds_all = tuple(k for k in a.kinds.split(",") if k)
  unknown = set(kinds_all) - set(PROCESS_FAULTS + RETRIEVER_FAULTS + STATE_FAULTS)
  if unknown or not kinds_all:
    raise SystemExit(f"unknown fault kinds {sorted(unknown)} in --kinds={a.kinds!r}")
  rnd = random.Random(a.seed)
  work = a.work or tempfile.mkdtemp(prefix="trace_chaos_")
  jit_cache = os.path.join(work, "jit")
  a.cache = os.path.abspath(a.cache)
  # The server needs the world on disk: one short run builds world and warm start first.
  ref = os.path.join(work, "reference")
  world_dir = os.path.join(a.cache, "world-seed0")
  # A run of zero RL steps with the in-process retriever builds (or finds) world and warm start,
  # so the server can serve the world and the timed reference run measures a cached start.
  boot = [x for x in run_args(a, os.path.join(work, "boot"), 0) if "retriever" not in x]
  subprocess.run(boot + ["--config.rl.steps=0"], cwd=ROOT, env=env(jit_cache), check=True,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  server, port = start_server(world_dir)
  proxy = FaultProxy(port, stall_s=a.timeout + 1.0)
  t0 = time.time()
  p = subprocess.run(run_args(a, ref, proxy.port), cwd=ROOT, env=env(jit_cache),
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  if p.returncode != 0:
    raise SystemExit(f"reference run failed:\n{p.stdout[-3000:]}")
  # The faults are timed from a second, warm run (the first one compiled), which must also equal
  # the first: a determinism check before any fault.
  t0 = time.time()
  warm = os.path.join(work, "reference_warm")
  p = subprocess.run(run_args(a, warm, proxy.port), cwd=ROOT, env=env(jit_cache),
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  if p.returncode != 0 or records(warm) != records(ref) or not same_state(warm, ref, a.steps):
    raise SystemExit(f"two uninterrupted runs differ (rc={p.returncode}): no fault can be judged")
  ref_seconds = time.time() - t0
  nan_refs = {}

  def nan_reference(step):  # an uninterrupted run with the same NaN step, made once per step
    if step not in nan_refs:
      d = os.path.join(work, f"reference_nan{step}")
      q = subprocess.run(run_args(a, d, proxy.port) + [f"--nan_steps={step}"],
                         cwd=ROOT, env=env(jit_cache), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
      if q.returncode != 0:
        raise SystemExit(f"reference run with a NaN at step {step} failed:\n{q.stdout[-3000:]}")
      nan_refs[step] = d
    return nan_refs[step]
  ref_calls = sum(r.get("retriever_calls", 0) for r in
                  (json.loads(x) for x in open(os.path.join(ref, "metrics.jsonl"))))
  print(f"reference run: {ref_seconds:.0f}s, {ref_calls} retriever calls", flush=True)
  trials, injected = [], 0
  ti = 0
  while injected < a.faults:
    ti += 1
    workdir = os.path.join(work, f"trial{ti}")
    kinds = [rnd.choice(kinds_all) for _ in range(min(a.per_trial, a.faults - injected))]
    log, attempts = [], 0
    nan_step, extra, trial_ref = None, [], ref
    if "nan" in kinds:  # one NaN step per trial, chosen before the run starts
      nan_step = rnd.randint(1, a.steps - 1)
      extra = [f"--nan_steps={nan_step}"]
      trial_ref = nan_reference(nan_step)
      log.append({"fault": "nan", "attempt": 1, "step": nan_step})
    todo = [k for k in kinds if k not in STATE_FAULTS]
    while True:
      attempts += 1
      proc = subprocess.Popen(run_args(a, workdir, proxy.port) + extra, cwd=ROOT,
                              env=env(jit_cache),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      out = []
      reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
      reader.start()
      # Faults of this attempt one after another at random moments, until a process fault ends
      # it (the next attempt, a rerun of the same command, takes the rest) or the run finishes.
      while todo and proc.poll() is None:
        kind = todo.pop(0)
        delay = rnd.uniform(0.15, 0.6) * ref_seconds
        deadline = time.time() + delay
        while time.time() < deadline and proc.poll() is None:
          time.sleep(0.1)
        entry = {"fault": kind, "attempt": attempts, "after_s": round(delay, 1)}
        log.append(entry)
        if proc.poll() is not None:
          entry["note"] = "the run had finished before the fault"
          break
        if kind == "sigterm":
          proc.send_signal(signal.SIGTERM)
          break
        if kind == "kill9":
          proc.kill()
          break
        if kind == "server_restart":
          t_down = time.time()
          server.kill()
          server.wait()
          time.sleep(0.5)
          server, port = start_server(world_dir)
          proxy.upstream = port
          entry["down_s"] = round(time.time() - t_down, 1)
        else:
          proxy.arm(kind)
      rc = proc.wait(timeout=1800)
      reader.join(timeout=5)
      if log and log[-1]["attempt"] == attempts and log[-1]["fault"] in PROCESS_FAULTS:
        log[-1]["exit"] = rc
      if rc == 0:
        break
      if rc not in (75, -9, -15) or attempts > 3 * a.per_trial:
        log.append({"fault": "unexpected_exit", "exit": rc, "tail": "".join(out)[-1500:]})
        break
    finished = rc == 0
    got = records(workdir) if finished else []  # each run's records read once
    want = records(trial_ref) if finished else []
    same_records = finished and got == want
    same_params = finished and same_state(workdir, trial_ref, a.steps)
    rl = {r["step"]: r for r in got if "effective_ratio" in r}
    trial = dict(trial=ti, faults=log, attempts=attempts, finished=finished,
                 identical_records=same_records, identical_params=same_params,
                 each_step_once=[r["step"] for r in got if "effective_ratio" in r]
                 == list(range(1, a.steps + 1)),
                 retriever_faults_injected=list(proxy.injected))
    if finished and not same_records:  # where the trial first left the reference, for the log
      for x, y in zip(got, want):
        if x != y:
          trial["first_difference"] = dict(
              step=x.get("step"), keys=sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k)))
          break
    if nan_step is not None:
      arrays = final_arrays(workdir, a.steps) if finished else []
      trial["nan_step_skipped"] = bool(
          finished and rl[nan_step + 1].get("finite") == 0.0
          and rl[a.steps].get("skipped_steps") == 1
          and all(np.isfinite(x).all() for x in arrays if np.issubdtype(x.dtype, np.floating)))
    proxy.injected.clear()
    trials.append(trial)
    injected += sum(1 for f in log if f["fault"] != "unexpected_exit" and "note" not in f)
    print(json.dumps(trial), flush=True)
    shutil.rmtree(workdir, ignore_errors=True)
  proxy.close()
  server.kill()
  faults = [f for t in trials for f in t["faults"]
            if f["fault"] != "unexpected_exit" and "note" not in f]
  ok = [t for t in trials if t["finished"] and t["identical_records"] and t["identical_params"]
        and t["each_step_once"] and t.get("nan_step_skipped", True)]
  summary = dict(command="python benchmarks/chaos.py " + " ".join(sys.argv[1:]),
                 faults_injected=len(faults),
                 by_kind={k: sum(f["fault"] == k for f in faults)
                          for k in PROCESS_FAULTS + RETRIEVER_FAULTS + STATE_FAULTS},
                 trials=len(trials), trials_identical_to_reference=len(ok),
                 reference_seconds=round(ref_seconds, 1), reference_retriever_calls=ref_calls,
                 runs=trials)
  os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
  with open(a.out, "w") as f:
    json.dump(summary, f, indent=1)
  print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=1))
  if len(ok) != len(trials):
    sys.exit(1)


if __name__ == "__main__":
  main()
