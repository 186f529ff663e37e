"""Multi-controller initialization: one process per host, `jax.distributed` as the engine."""

from __future__ import annotations

import os

import jax

_ENV = {
    "coordinator_address": ("TRACE_JAX_COORDINATOR", "JAX_COORDINATOR_ADDRESS"),
    "num_processes": ("TRACE_JAX_NUM_PROCESSES", "JAX_NUM_PROCESSES"),
    "process_id": ("TRACE_JAX_PROCESS_ID", "JAX_PROCESS_ID"),
}
_initialized = False


def _from_env(key):
  for name in _ENV[key]:
    if os.environ.get(name):
      return os.environ[name]
  return None


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_ids=None, auto: bool = False) -> bool:
  """Calls `jax.distributed.initialize` when a multi-process run is configured.

  Arguments win over the environment (`TRACE_JAX_COORDINATOR` / `JAX_COORDINATOR_ADDRESS`,
  `..._NUM_PROCESSES`, `..._PROCESS_ID`). With nothing configured and `auto=False` this is a no-op
  (single process) and returns False. `auto=True` lets JAX detect a cluster (TPU pods, SLURM).
  On CPU, cross-process collectives use gloo.
  """
  global _initialized
  if _initialized:
    return True
  addr = coordinator_address or _from_env("coordinator_address")
  n = num_processes if num_processes is not None else _from_env("num_processes")
  pid = process_id if process_id is not None else _from_env("process_id")
  if addr is None and not auto:
    if n not in (None, 1, "1"):
      raise ValueError(f"num_processes={n} needs a coordinator address "
                       "(--coordinator or TRACE_JAX_COORDINATOR)")
    return False
  if addr is not None and (n is None or pid is None):
    raise ValueError("a coordinator address needs both num_processes and process_id")
  try:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  except (AttributeError, ValueError):  # option renamed or absent in this jax version
    pass
  kw = {}
  if addr is not None:
    kw = dict(coordinator_address=addr, num_processes=int(n), process_id=int(pid))
  if local_device_ids is not None:
    kw["local_device_ids"] = local_device_ids
  jax.distributed.initialize(**kw)
  _initialized = True
  return True
