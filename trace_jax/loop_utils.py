"""The training loop's plumbing that is not a step of it: which process writes the run's files,
host copies of global arrays, the retriever's counters, the jitted predictor the driver reads,
the parameter norm, the default workdir, SIGTERM/SIGINT as a flag, and XLA's compilation cache.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import jax
import numpy as np
import optax
from flax import nnx

from trace_jax.config import TrainConfig
from trace_jax.parallel import allgather_object, fetch
from trace_jax.parallel.micro_batch import padded_rows


def is_primary() -> bool:
  """Whether this process writes the run's files (the only process, or process 0 of several)."""
  return jax.process_index() == 0


class NullWriter:
  """`MetricWriter`'s interface for processes other than process 0: records go nowhere."""
  path = None

  def write(self, step: int, record: dict) -> None:
    pass

  def truncate(self, last_step: int) -> int:
    return 0

  def close(self) -> None:
    pass


def host_tree(tree):
  """A pytree of (possibly global) arrays as host values; one process: unchanged."""
  return tree if jax.process_count() == 1 else jax.tree.map(fetch, tree)


def retriever_stats(env) -> dict:
  """The environment's retriever counters since the last call, summed over the processes (the
  mean latency weighted by calls, the max over processes)."""
  if not hasattr(env, "retriever_stats"):  # a task without a retriever
    return {}
  st = env.retriever_stats(reset=True)
  if jax.process_count() == 1:
    return st
  parts = allgather_object(st)
  out = {k: sum(p.get(k, 0) for p in parts) for k in st}
  calls = out.get("retriever_calls", 0)
  if "retriever_latency_mean_s" in st:
    out["retriever_latency_mean_s"] = (sum(p["retriever_latency_mean_s"] * p["retriever_calls"]
                                           for p in parts) / calls if calls else 0.0)
  if "retriever_latency_max_s" in st:
    out["retriever_latency_max_s"] = max(p["retriever_latency_max_s"] for p in parts)
  return out


def make_predictor(pred_graphdef):
  """Jitted p̂ from features [N, D], padded to buckets of 64 rows (one compile per bucket)."""
  @jax.jit
  def _probs(pred_state, feats):
    return nnx.merge(pred_graphdef, pred_state).prob(feats)

  def predict(pred_state, feats):
    feats = np.asarray(feats, np.float32)
    n = feats.shape[0]
    pad = np.zeros((padded_rows(n, 1, 64), feats.shape[1]), np.float32)  # 64-row buckets
    pad[:n] = feats
    return np.asarray(_probs(pred_state, pad))[:n]

  return predict


@jax.jit
def global_norm(params):
  """The global L2 norm of a pytree of parameters (f32[], jitted)."""
  return optax.tree.norm(params)


def default_workdir(c: TrainConfig) -> str:
  """`c.workdir`, or runs/<variant>-<method>-seed<seed>-<time stamp>."""
  if c.workdir:
    return c.workdir
  stamp = time.strftime("%Y%m%d-%H%M%S")
  return os.path.join("runs", f"{c.variant}-{c.method}-seed{c.seed}-{stamp}")


class StopSignal:
  """Turns SIGTERM/SIGINT into a flag the loop reads between steps (installed by `train` in the
  main thread only); `requested` names the signal once one arrived."""

  def __init__(self):
    self.requested, self._old = None, {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._old[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame):
    if self.requested is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt  # a second Ctrl-C stops at once
    self.requested = signal.Signals(signum).name
    print(f"\n[trace_jax] {self.requested}: finishing this step, then checkpointing", flush=True)

  def agree(self) -> None:
    """Several processes: a signal to any of them stops all of them at the same step (they
    checkpoint together). A collective; one process: nothing to do."""
    if jax.process_count() > 1:
      self.requested = next((r for r in allgather_object(self.requested) if r), None)

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)


def use_compile_cache(path: str, min_compile_s: float = 0.5) -> str | None:
  """Turns on XLA's persistent compilation cache under `path`; call it before anything compiles.
  A compiled function is stored on disk and the next process that needs the same computation
  loads it instead of compiling, so only a machine's first run of a shape pays for it (a
  campaign's runs share every shape). What a run computes does not change (the same program is
  loaded), so resume stays exact. Returns the directory used, or None when `path` is empty or
  JAX_COMPILATION_CACHE_DIR is set (the environment wins)."""
  if not path or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return None
  path = os.path.abspath(path)
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_s)
  return path
