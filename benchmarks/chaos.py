"""A randomized fault campaign against the training loop (smoke size, real local retrieval server).

  python benchmarks/chaos.py --faults=100 --per_trial=5 --out=results/chaos.json

First an uninterrupted reference run. Then trials: each starts a fresh run of the same config and
injects faults while it trains: SIGTERM or kill -9 of the trainer at a random moment (which often
falls inside a checkpoint write), and retrieval faults through a fault-injecting proxy between the
trainer and the server (a stall past the client's timeout, HTTP 500s, malformed replies, dropped
connections, the server killed and restarted). After a process fault the trial reruns the same
command, as a scheduler would, until the run finishes. Every finished run must equal the reference:
the same RL and eval records (timings and retriever counters aside: faults cost retries) and
bit-identical final parameters. A `nan` fault gives one random RL step a NaN loss
(`tests/faults.py --nan_steps`): that trial's reference is an uninterrupted run with the same
NaN, and the trial must also show the step skipped (recorded, counted once) and every saved array
finite.

`kill_one_of_two` runs the trial as two JAX processes on 127.0.0.1 (a coordinator, one global
mesh, as `tests/test_multiprocess_train.py` launches them) and kills one of them, drawn at random,
with SIGKILL mid-step: a few seconds after a checkpoint the attempt wrote, at a step drawn at
random (with one step left, into its start-up). The survivor must stop by itself
(the peer's missing heartbeats, `--heartbeat_s`); one still running `--hang_s` seconds after the
kill is killed and the fault's record says so (`survivor.hung`, counted in `survivor_hangs`). Then
both are started again with the same command, as a scheduler would, and resume from the last
checkpoint (`resumed_at`: the step each process resumed at, per restart). Its reference is an
uninterrupted two-process run (made once, twice over: two of them must agree before any such fault
is judged). A two-process trial takes retrieval faults too; any other kind drawn for it is drawn
again among those.

`quarter_pool` runs the trial with `--config.rollout.num_pages` at a quarter of the pages the
reference needed (its `sampler_peak_pages` metric, or, where the reference has none, a quarter of
its configured pool; the trial says which). The engine preempts branches instead of cutting them,
so the records must still equal the reference's, save what a smaller pool changes by design: the
sampler's own metrics (`sampler_*`), the prefill counts (`*prefill_tokens`: preempted branches
recompute their K/V) and the ledger's counts of decode steps, slot steps, preemptions and
recomputed tokens. A preempted branch's K/V is recomputed by a prefill, equal to what the decode
step wrote up to float rounding, so this kind is judged up to rounding
(`trace_jax.record_compare`): every token, reward and count equal, every float field within 1e-5
relative (or both below 1e-9), every parameter array within 1e-5 of its largest magnitude
(`POOL_PARAMS_REL`); the trial records how close it came (`pool.records_max_relative`,
`pool.params_max_relative`) and whether it was bit-identical (`first_difference` absent).

Writes every fault tried and its outcome to `--out`; `--kinds` draws from some kinds only.
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

import re
import socket

import numpy as np

from trace_jax.record_compare import array_difference, compare_records

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
RETRIEVER_FAULTS = ("stall", "http500", "malformed", "drop", "server_restart")
PROCESS_FAULTS = ("sigterm", "kill9")
PAIR_FAULTS = ("kill_one_of_two",)  # a two-process run, one process killed with SIGKILL
# Set before the run starts: a NaN loss at a random RL step (`tests/faults.py --nan_steps`), a KV
# pool at a quarter of the reference's need.
STATE_FAULTS = ("nan", "quarter_pool")
POOL_PARAMS_REL = 1e-5  # a quarter_pool trial's parameters: max |a - b| / max |b| per array
KINDS = PROCESS_FAULTS + PAIR_FAULTS + RETRIEVER_FAULTS + STATE_FAULTS
PAIR_KINDS = PAIR_FAULTS + RETRIEVER_FAULTS  # the kinds a two-process trial takes
IGNORED = ("seconds", "wall", "retriever_")
# Counts a quarter pool changes by design (the sampler's time and its recomputation), besides the
# `sampler_*` metrics and the `*prefill_tokens` counts.
POOL_COUNTERS = ("ledger_decode_steps", "ledger_busy_slot_steps", "ledger_total_slot_steps",
                 "ledger_empty_slot_steps", "ledger_preemptions", "ledger_recomputed_tokens")


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


_SERVERS: list = []  # every retrieval server started: stopped however the campaign ends


def start_server(world_dir: str, port: int = 0):
  p = subprocess.Popen([sys.executable, os.path.join(ROOT, "launch", "retrieval_server.py"),
                        "--world", world_dir, "--port", str(port), "--log_level", "WARNING"],
                       cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  _SERVERS.append(p)
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


def pair_env(base: dict, port: int, process_id: int, heartbeat_s: int, gather_s: int) -> dict:
  """The environment of process `process_id` of a two-process run (coordinator on 127.0.0.1:port):
  every cross-process wait bounded, a dead peer declared after `heartbeat_s` seconds."""
  return dict(base, TRACE_JAX_COORDINATOR=f"127.0.0.1:{port}", TRACE_JAX_NUM_PROCESSES="2",
              TRACE_JAX_PROCESS_ID=str(process_id), TRACE_JAX_INIT_TIMEOUT="120",
              TRACE_JAX_HEARTBEAT_TIMEOUT=str(heartbeat_s), TRACE_JAX_GATHER_TIMEOUT=str(gather_s),
              TRACE_JAX_SHUTDOWN_TIMEOUT="60")


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def stop_within(proc, bound_s: float) -> dict:
  """Waits up to `bound_s` seconds for `proc` to exit, kills it past that: its exit status, the
  seconds it took and whether it had to be killed (`hung`)."""
  t0 = time.time()
  try:
    rc, hung = proc.wait(timeout=bound_s), False
  except subprocess.TimeoutExpired:
    proc.kill()
    rc, hung = proc.wait(), True
  return dict(exit=rc, exit_after_s=round(time.time() - t0, 1), hung=hung)


class Attempt:
  """One run of a trial's command: one process, or two (a two-process run), each with its
  output collected."""

  def __init__(self, cmd: list, envs: list[dict]):
    self.procs, self.outs = [], []
    for e in envs:
      p = subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
      out: list[str] = []
      threading.Thread(target=lambda p=p, out=out: out.extend(p.stdout), daemon=True).start()
      self.procs.append(p)
      self.outs.append(out)
    self.killed_after_peer: list[dict] = []  # processes that outlived a failed peer too long
    self.timed_out = False

  def running(self) -> bool:
    """Every process still running (one that has exited ends the attempt's faults)."""
    return all(p.poll() is None for p in self.procs)

  def finish(self, timeout: float, bound_s: float) -> list[int]:
    """Waits for every process; once one has failed, the others get `bound_s` seconds to stop
    before they are killed (`killed_after_peer`); past `timeout` all are killed. Exit statuses."""
    deadline = time.time() + timeout
    while any(p.poll() is None for p in self.procs):
      failed = any(p.poll() not in (None, 0) for p in self.procs)
      if failed or time.time() > deadline:
        self.timed_out = not failed
        for i, p in enumerate(self.procs):
          if p.poll() is None:
            r = stop_within(p, bound_s if failed else 0)
            if r["hung"]:
              self.killed_after_peer.append(dict(process=i, **r))
        break
      time.sleep(0.2)
    for p in self.procs:
      p.wait()
    time.sleep(0.2)  # the readers take the last lines
    return [p.returncode for p in self.procs]

  def output(self, i: int = 0) -> str:
    return "".join(self.outs[i])


def draw_kinds(rnd: random.Random, kinds_all, n: int) -> list[str]:
  """A trial's `n` fault kinds, drawn from `kinds_all`. A trial that draws a two-process fault runs
  as two processes: every kind it drew that such a run does not take (`PAIR_KINDS`) is drawn again
  among those it does."""
  kinds = [rnd.choice(kinds_all) for _ in range(n)]
  if any(k in PAIR_FAULTS for k in kinds):
    allowed = [k for k in kinds_all if k in PAIR_KINDS]
    kinds = [k if k in PAIR_KINDS else rnd.choice(allowed) for k in kinds]
  return kinds


def pool_dependent(key: str) -> bool:
  """A metric a KV pool at a fraction of the need changes by design (see the module doc)."""
  return key.startswith("sampler_") or key.endswith("prefill_tokens") or key in POOL_COUNTERS


def comparable(recs: list[dict], pool: bool) -> list[dict]:
  """The records a trial is compared on: all of them, or, for a smaller pool, without the
  metrics it changes by design."""
  return [{k: v for k, v in r.items() if not pool_dependent(k)} for r in recs] if pool else recs


def _same(u, v) -> bool:
  """Equal values, a NaN equal to a NaN (as the records' comparison takes them)."""
  if isinstance(u, float) and isinstance(v, float) and u != u and v != v:
    return True
  return u is v or u == v


def first_difference(got: list[dict], want: list[dict]) -> dict | None:
  """Where two lists of records first differ: the step and the keys, or the counts."""
  for x, y in zip(got, want):
    keys = sorted(k for k in set(x) | set(y) if k not in x or k not in y
                  or not _same(x[k], y[k]))
    if keys:
      return dict(step=x.get("step"), keys=keys)
  if len(got) != len(want):
    return dict(records=len(got), reference_records=len(want))
  return None


def largest_relative_difference(got: list[dict], want: list[dict]) -> dict:
  """The numbers two lists of records disagree on, by key: the largest relative difference of
  each (how far a trial that is not identical is from its reference)."""
  out: dict[str, float] = {}
  for x, y in zip(got, want):
    for k in set(x) & set(y):
      u, v = x[k], y[k]
      if (isinstance(u, (int, float)) and isinstance(v, (int, float)) and not _same(u, v)
          and not isinstance(u, bool)):
        rel = abs(u - v) / max(abs(u), abs(v), 1e-30)
        out[k] = max(out.get(k, 0.0), float(rel))
  return dict(sorted(out.items()))


def quarter_pool(ref_recs: list[dict], configured: int) -> dict:
  """The pool of a `quarter_pool` trial: a quarter (rounded up) of the pages the reference used at
  its peak (`sampler_peak_pages`, the largest over its records), or of its configured pool where
  no record has that metric."""
  peaks = [int(r["sampler_peak_pages"]) for r in ref_recs if "sampler_peak_pages" in r]
  if peaks:
    need, basis = max(peaks), "sampler_peak_pages of the reference"
  else:
    need, basis = int(configured), ("configured num_pages (the reference records no "
                                    "sampler_peak_pages)")
  return dict(pages=max(1, -(-need // 4)), need=need, basis=basis)


def raw_records(workdir):
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def records(workdir):
  return [{k: v for k, v in r.items() if not any(t in k for t in IGNORED)}
          for r in raw_records(workdir) if r["step"] >= 0]


def rl_steps_recorded(workdir) -> int:
  try:
    return sum(1 for r in raw_records(workdir) if "effective_ratio" in r)
  except (OSError, ValueError):  # a line being written
    return -1


def checkpoints(workdir) -> list:
  d = os.path.join(workdir, "checkpoints")
  return sorted(int(x) for x in os.listdir(d) if x.isdigit()) if os.path.isdir(d) else []


def resumed_at(output: str):
  m = re.search(r"resumed at step (\d+)", output)
  return int(m.group(1)) if m else None


def final_arrays(workdir, step):
  """The arrays of a run's checkpoint `step`, on this process's one device (a two-process run's
  checkpoint was saved over both processes' devices)."""
  import jax
  import orbax.checkpoint as ocp
  from absl import logging as absl_logging
  absl_logging.set_verbosity(absl_logging.ERROR)  # (no per-step metadata file: not an error)
  path = os.path.join(os.path.abspath(workdir), "checkpoints", str(step), "state")
  ckptr = ocp.StandardCheckpointer()
  meta = ckptr.metadata(path)
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one),
                        getattr(meta, "item_metadata", meta))
  return [np.asarray(x) for x in jax.tree.leaves(ckptr.restore(path, target))]


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
  ap.add_argument("--heartbeat_s", type=int, default=60,
                  help="two-process runs: seconds without heartbeats before a peer counts as dead")
  ap.add_argument("--gather_s", type=int, default=300,
                  help="two-process runs: the bound of a wait for the peer's host data")
  ap.add_argument("--hang_s", type=float, default=300,
                  help="seconds the survivor of a killed peer gets to stop before it is killed")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--work", default="", help="scratch directory (default: a temporary one)")
  ap.add_argument("--cache", default="cache/chaos", help="world and warm-start cache")
  ap.add_argument("--out", default="results/chaos.json")
  ap.add_argument("--kinds", default=",".join(KINDS), help="fault kinds to draw from")
  a = ap.parse_args()
  kinds_all = tuple(k for k in a.kinds.split(",") if k)
  unknown = set(kinds_all) - set(KINDS)
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
  with open(os.path.join(ref, "config.json")) as f:
    pool = quarter_pool(raw_records(ref), json.load(f)["rollout"]["num_pages"])
  nan_refs, pair_ref = {}, {}

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

  def start(workdir, extra, pair):
    cmd = run_args(a, workdir, proxy.port) + extra
    if not pair:
      return Attempt(cmd, [env(jit_cache)])
    port = free_port()  # a fresh coordinator for every start
    return Attempt(cmd, [pair_env(env(jit_cache), port, i, a.heartbeat_s, a.gather_s)
                         for i in range(2)])

  def pair_reference():
    """Two uninterrupted two-process runs (the first compiles) that must agree; the second's
    wall time times the faults."""
    if not pair_ref:
      for name in ("reference_pair", "reference_pair_warm"):
        d = os.path.join(work, name)
        t1 = time.time()
        att = start(d, [], True)
        rcs = att.finish(1800, a.hang_s)
        if any(rcs):
          raise SystemExit(f"two-process reference run failed ({rcs}):\n"
                           + "\n".join(att.output(i)[-2000:] for i in range(2)))
        pair_ref[name] = d
        pair_ref["seconds"] = time.time() - t1
      d1, d2 = pair_ref["reference_pair"], pair_ref["reference_pair_warm"]
      if records(d1) != records(d2) or not same_state(d1, d2, a.steps):
        raise SystemExit("two uninterrupted two-process runs differ: no kill_one_of_two fault "
                         "can be judged")
      print(f"two-process reference run: {pair_ref['seconds']:.0f}s", flush=True)
    return pair_ref["reference_pair"], pair_ref["seconds"]

  ref_calls = sum(r.get("retriever_calls", 0) for r in raw_records(ref))
  print(f"reference run: {ref_seconds:.0f}s, {ref_calls} retriever calls; quarter pool "
        f"{pool['pages']} pages ({pool['basis']}: {pool['need']})", flush=True)
  trials, injected = [], 0
  ti = 0
  while injected < a.faults:
    ti += 1
    workdir = os.path.join(work, f"trial{ti}")
    kinds = draw_kinds(rnd, kinds_all, min(a.per_trial, a.faults - injected))
    pair = any(k in PAIR_FAULTS for k in kinds)
    log, attempts, resumed = [], 0, []
    nan_step, extra, trial_ref, run_seconds = None, [], ref, ref_seconds
    if pair:
      trial_ref, run_seconds = pair_reference()
    if "nan" in kinds:  # one NaN step per trial, chosen before the run starts
      nan_step = rnd.randint(1, a.steps - 1)
      extra = [f"--nan_steps={nan_step}"]
      trial_ref = nan_reference(nan_step)
      log.append({"fault": "nan", "attempt": 1, "step": nan_step})
    small_pool = "quarter_pool" in kinds
    if small_pool:  # the whole trial on a quarter of the pool
      extra = extra + [f"--config.rollout.num_pages={pool['pages']}"]
      log.append({"fault": "quarter_pool", "attempt": 1, "num_pages": pool["pages"],
                  "need": pool["need"], "basis": pool["basis"]})
    todo = [k for k in kinds if k not in STATE_FAULTS]
    while True:
      attempts += 1
      att = start(workdir, extra, pair)
      # Faults of this attempt one after another at random moments, until a process fault ends
      # it (the next attempt, a rerun of the same command, takes the rest) or the run finishes.
      while todo and att.running():
        kind = todo.pop(0)
        t_wait, target = time.time(), None
        if kind in PAIR_FAULTS:
          # Mid-step: a few seconds after the run's k-th new checkpoint (k drawn among the steps
          # it has still to make, the last aside), so both processes resume from a checkpoint
          # this attempt wrote; with one step left, into its start-up.
          c0 = max(checkpoints(workdir), default=0)
          target = c0 + rnd.randint(1, a.steps - c0 - 1) if a.steps - c0 >= 2 else c0
          limit = t_wait + 3 * run_seconds
          while (att.running() and max(checkpoints(workdir), default=0) < target
                 and time.time() < limit):
            time.sleep(0.2)
          delay = rnd.uniform(0.5, 4.0)
        else:
          delay = rnd.uniform(0.15, 0.6) * run_seconds
        deadline = time.time() + delay
        while time.time() < deadline and att.running():
          time.sleep(0.1)
        entry = {"fault": kind, "attempt": attempts, "after_s": round(time.time() - t_wait, 1)}
        if target is not None:
          entry["after_checkpoint"] = target
        log.append(entry)
        if not att.running():
          entry["note"] = "the run had finished before the fault"
          break
        if kind in PROCESS_FAULTS + PAIR_FAULTS:  # where the run was when it was hit
          entry.update(rl_steps_recorded=rl_steps_recorded(workdir),
                       checkpoints=checkpoints(workdir))
        if kind == "sigterm":
          att.procs[0].send_signal(signal.SIGTERM)
          break
        if kind == "kill9":
          att.procs[0].kill()
          break
        if kind == "kill_one_of_two":
          victim = rnd.randrange(2)
          att.procs[victim].kill()
          att.procs[victim].wait()
          # The survivor must stop by itself once its peer is gone; past --hang_s it is killed
          # and the record says so.
          entry.update(process=victim, survivor=dict(
              process=1 - victim, **stop_within(att.procs[1 - victim], a.hang_s)))
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
      rcs = att.finish(1800, a.hang_s)
      rc = next((r for r in rcs if r != 0), 0)
      if attempts > 1:
        resumed.append([resumed_at(att.output(i)) for i in range(len(rcs))])
      ours = (log and log[-1]["attempt"] == attempts
              and log[-1]["fault"] in PROCESS_FAULTS + PAIR_FAULTS)
      if ours:
        log[-1]["exit"] = rcs if pair else rc
      if rc == 0:
        break
      # A killed process's peer exits however its runtime stops it: any status is expected.
      expected = (ours and "note" not in log[-1]) if pair else rc in (75, -9, -15)
      if not expected or att.timed_out or attempts > 3 * a.per_trial:
        log.append({"fault": "unexpected_exit", "exit": rcs if pair else rc,
                    "timed_out": att.timed_out, "killed_after_peer": att.killed_after_peer,
                    "tail": "\n".join(att.output(i)[-1500:] for i in range(len(rcs)))})
        break
    finished = rc == 0
    got = records(workdir) if finished else []  # each run's records read once
    want = records(trial_ref) if finished else []
    diff = first_difference(comparable(got, small_pool), comparable(want, small_pool))
    same_records = finished and diff is None
    if small_pool and finished:  # recomputed K/V: identical up to float rounding (module doc)
      rounding = compare_records(comparable(got, True), comparable(want, True))
      params_rel = array_difference(final_arrays(workdir, a.steps),
                                    final_arrays(trial_ref, a.steps))
      same_records = not rounding["different"]
      same_params = params_rel <= POOL_PARAMS_REL
    else:
      same_params = finished and same_state(workdir, trial_ref, a.steps)
    rl = {r["step"]: r for r in got if "effective_ratio" in r}
    trial = dict(trial=ti, processes=2 if pair else 1, faults=log, attempts=attempts,
                 finished=finished, identical_records=same_records,
                 identical_params=same_params,
                 each_step_once=[r["step"] for r in got if "effective_ratio" in r]
                 == list(range(1, a.steps + 1)),
                 retriever_faults_injected=list(proxy.injected))
    if resumed:  # the step each restart resumed at (per process)
      trial["resumed_at"] = resumed
    if pair:
      trial["survivor_hung"] = any(f.get("survivor", {}).get("hung") for f in log)
    if small_pool:
      want_rl = [r for r in want if "effective_ratio" in r]
      def total(recs, name):  # the sampler's counter, under either of its record names
        return sum(r.get(f"sampler_{name}", r.get(f"ledger_{name}", 0)) or 0 for r in recs)
      trial["pool"] = dict(
          num_pages=pool["pages"],
          peak_pages=max((r.get("sampler_peak_pages", 0) for r in rl.values()), default=0),
          preemptions=total(rl.values(), "preemptions"),
          recomputed_tokens=total(rl.values(), "recomputed_tokens"),
          system_cut_leaves=sum(r.get("system_cut_leaves", 0) for r in rl.values()),
          reference_system_cut_leaves=sum(r.get("system_cut_leaves", 0) for r in want_rl))
      if finished:
        trial["pool"].update(
            records_equal=rounding["equal"], records_rounding=rounding["rounding"],
            records_different=rounding["different"][:20],
            records_max_relative=rounding["max_relative"], params_max_relative=params_rel)
      if finished and diff is not None:  # how far from bit-identical, key by key
        trial["pool"]["largest_relative_difference"] = largest_relative_difference(
            comparable(got, True), comparable(want, True))
    if finished and diff is not None:  # where the trial first left the reference, for the log
      trial["first_difference"] = diff
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
                 by_kind={k: sum(f["fault"] == k for f in faults) for k in KINDS},
                 trials=len(trials), trials_identical_to_reference=len(ok),
                 survivor_hangs=sum(bool(f.get("survivor", {}).get("hung")) for f in faults),
                 reference_seconds=round(ref_seconds, 1), reference_retriever_calls=ref_calls,
                 pair_reference_seconds=round(pair_ref["seconds"], 1) if pair_ref else None,
                 quarter_pool=pool, runs=trials)
  os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
  with open(a.out, "w") as f:
    json.dump(summary, f, indent=1)
  print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=1))
  if len(ok) != len(trials):
    sys.exit(1)


if __name__ == "__main__":
  try:
    main()
  finally:
    for server_proc in _SERVERS:
      if server_proc.poll() is None:
        server_proc.kill()
