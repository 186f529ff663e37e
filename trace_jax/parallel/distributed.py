"""Multi-controller runs: one process per host, `jax.distributed` as the engine.

`initialize` joins the processes. The helpers below are what a training loop needs around a
global mesh: host objects gathered from every process (`allgather_object`), arrays moved between a
process's own devices and the global mesh (`put_global`, `fetch`, `to_local`), and the block of the
mesh a process owns (`local_mesh`). With one process each helper is the identity or its plain
single-process counterpart.
"""

from __future__ import annotations

import os
import pickle

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

_ENV = {
    "coordinator_address": ("TRACE_JAX_COORDINATOR", "JAX_COORDINATOR_ADDRESS"),
    "num_processes": ("TRACE_JAX_NUM_PROCESSES", "JAX_NUM_PROCESSES"),
    "process_id": ("TRACE_JAX_PROCESS_ID", "JAX_PROCESS_ID"),
}
# Seconds: how long to wait for every process to join, after which a silent process counts as dead
# (the others then fail instead of waiting on it in a collective), and how long a finished process
# waits for the others at shutdown.
_TIMEOUTS = {
    "initialization_timeout": ("TRACE_JAX_INIT_TIMEOUT", 300),
    "heartbeat_timeout_seconds": ("TRACE_JAX_HEARTBEAT_TIMEOUT", 100),
    "shutdown_timeout_seconds": ("TRACE_JAX_SHUTDOWN_TIMEOUT", 300),
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
  On CPU, cross-process collectives use gloo. Every cross-process wait is bounded: the join by
  `TRACE_JAX_INIT_TIMEOUT` seconds, a dead peer is declared after `TRACE_JAX_HEARTBEAT_TIMEOUT`
  seconds without heartbeats (the survivors then stop with an error instead of hanging in a
  collective), and the shutdown barrier by `TRACE_JAX_SHUTDOWN_TIMEOUT`.
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
  for key, (env, default) in _TIMEOUTS.items():
    kw[key] = int(os.environ.get(env) or default)
  jax.distributed.initialize(**kw)
  _initialized = True
  return True


# ---- host objects across processes ---------------------------------------------------------------
# Host data goes through the coordination service's key-value store, not through device
# collectives: a process may reach a gather long after the others (its sampling ran longer), and
# every wait has an explicit timeout (`TRACE_JAX_GATHER_TIMEOUT` seconds, default one hour).
_CHUNK = 1 << 20  # bytes per stored value
_seq = {"gather": 0, "barrier": 0}


def _client():
  from jax._src import distributed as jd  # the runtime client `initialize` connected
  if jd.global_state.client is None:
    raise RuntimeError("several JAX processes but no distributed client: call initialize() first")
  return jd.global_state.client


def _timeout_ms() -> int:
  return int(float(os.environ.get("TRACE_JAX_GATHER_TIMEOUT") or 3600) * 1000)


def allgather_object(obj) -> list:
  """Every process's `obj` (picklable), in process order, on every process. A collective: every
  process must call it, in the same order (it waits for the others, up to the gather timeout).
  With one process: `[obj]`."""
  if jax.process_count() == 1:
    return [obj]
  client, rank, n = _client(), jax.process_index(), jax.process_count()
  seq = _seq["gather"]
  _seq["gather"] += 1
  blob = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
  chunks = [blob[i:i + _CHUNK] for i in range(0, len(blob), _CHUNK)] or [b""]
  base = f"trace_jax/gather/{seq}"
  for i, c in enumerate(chunks):
    client.key_value_set_bytes(f"{base}/{rank}/{i}", c)
  client.key_value_set(f"{base}/{rank}/n", str(len(chunks)))
  out = []
  for p in range(n):
    k = int(client.blocking_key_value_get(f"{base}/{p}/n", _timeout_ms()))
    out.append(pickle.loads(b"".join(client.blocking_key_value_get_bytes(f"{base}/{p}/{i}",
                                                                         _timeout_ms())
                                     for i in range(k))))
  if seq:  # every process has written this gather, so all have read the previous one: drop it
    client.key_value_delete(f"trace_jax/gather/{seq - 1}/{rank}")
  return out


def broadcast_object(obj):
  """Process 0's `obj` on every process (the others' values are not sent). A collective, like
  `allgather_object`. With one process: `obj`."""
  if jax.process_count() == 1:
    return obj
  return allgather_object(obj if jax.process_index() == 0 else None)[0]


def broadcast_arrays(tree):
  """Process 0's pytree of arrays as host-built jnp arrays on every process (`broadcast_object` of
  their numpy values)."""
  if jax.process_count() == 1:
    return tree
  import jax.numpy as jnp
  return jax.tree.map(jnp.asarray, broadcast_object(jax.tree.map(np.asarray, tree)))


def barrier(name: str) -> None:
  """Waits until every process reached the same barrier (up to the gather timeout)."""
  if jax.process_count() == 1:
    return
  seq = _seq["barrier"]
  _seq["barrier"] += 1
  _client().wait_at_barrier(f"trace_jax/{name}/{seq}", _timeout_ms())


def run_global(fn, *args):
  """Calls the jitted `fn` on arrays of a mesh that spans several processes. The first call of
  each signature is compiled on its own, then the processes meet at a barrier before it runs: CPU
  collectives (gloo) give a process only 30 s to join a new communicator, and compile times
  differ between processes. One process: `fn(*args)`."""
  if jax.process_count() == 1:
    return fn(*args)
  leaves, tree = jax.tree.flatten(args)
  key = (id(fn), tree, tuple((getattr(x, "shape", None), str(getattr(x, "dtype", type(x))),
                              getattr(x, "sharding", None)) for x in leaves))
  if key not in _COMPILED:
    _COMPILED[key] = fn.lower(*args).compile()
    barrier("compiled")
  return _COMPILED[key](*args)


_COMPILED: dict = {}


def check_agree(name: str, value) -> None:
  """Raises when the processes hold different `value`s (a host decision that must be global, e.g.
  a step's metrics): a multi-process run that silently diverged would train on mixed data."""
  if jax.process_count() == 1:
    return
  vals = allgather_object(value)
  if any(v != vals[0] for v in vals[1:]):
    raise RuntimeError(f"the {len(vals)} processes disagree on {name}: {vals}")


# ---- arrays between a process's devices and the global mesh --------------------------------------
def fetch(x) -> np.ndarray:
  """The full value of an array on this host (a fully replicated global array is read from a local
  copy; a sharded one is gathered from every process, a collective)."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    return np.asarray(x)
  if x.is_fully_replicated:
    return np.asarray(x.addressable_data(0))
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def put_global(x, sharding):
  """`jax.device_put(x, sharding)` for a value every process holds in full (same on all), also
  when `sharding` spans other processes' devices: each process places its own shards."""
  if sharding.is_fully_addressable:
    return jax.device_put(x, sharding)
  if isinstance(x, jax.Array) and not x.is_fully_addressable:  # already global: reshard on device
    return x if x.sharding == sharding else jax.jit(_identity, out_shardings=sharding)(x)
  host = np.asarray(fetch(x))
  return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def put_global_tree(tree, shardings):
  """`put_global` over a pytree; `shardings` may be a prefix of `tree` (e.g. one sharding per nnx
  Variable). Leaves already in their sharding are kept as they are."""
  def put(s, sub):
    return jax.tree.map(lambda x: x if getattr(x, "sharding", None) == s else put_global(x, s),
                        sub)
  return jax.tree.map(put, shardings, tree, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))


def _device_block(mesh: Mesh, process: int) -> tuple[slice, ...]:
  owner = np.vectorize(lambda d: d.process_index)(mesh.devices)
  idx = np.nonzero(owner == process)
  if not idx[0].size:
    raise ValueError(f"process {process} has no device in the mesh {dict(mesh.shape)}")
  box = tuple(slice(int(i.min()), int(i.max()) + 1) for i in idx)
  if (owner[box] != process).any() or owner[box].size != idx[0].size:
    raise ValueError(
        f"mesh {dict(mesh.shape)} does not split evenly over {jax.process_count()} processes: "
        f"the devices of process {process} are not one block of the mesh (choose axis sizes whose "
        f"leading axes split at process boundaries, e.g. data:{jax.process_count()},...)")
  return box


def local_mesh(mesh: Mesh) -> Mesh:
  """The block of `mesh` this process's devices form, as a mesh with the same axis names. Raises a
  ValueError when some process's devices are not one block of the mesh, or the blocks differ in
  shape (the mesh does not split evenly over the processes)."""
  if jax.process_count() == 1:
    return mesh
  shapes = set()
  for p in range(jax.process_count()):
    box = _device_block(mesh, p)
    shapes.add(tuple(b.stop - b.start for b in box))
  if len(shapes) != 1:
    raise ValueError(f"mesh {dict(mesh.shape)} does not split evenly over "
                     f"{jax.process_count()} processes (blocks {sorted(shapes)})")
  return Mesh(mesh.devices[_device_block(mesh, jax.process_index())], mesh.axis_names)


def process_mesh(mesh: Mesh) -> Mesh:
  """The global mesh's devices as (process, *axes): process p's block at index p."""
  blocks = [mesh.devices[_device_block(mesh, p)] for p in range(jax.process_count())]
  return Mesh(np.stack(blocks), ("process",) + tuple(mesh.axis_names))


_RESHARD: dict = {}


def _identity(xs):
  return xs


def to_local(tree, mesh: Mesh, local_shardings):
  """Copies a pytree of global arrays (on `mesh`) into this process's devices, laid out by
  `local_shardings` (NamedShardings on `local_mesh(mesh)`, same structure): one resharding program
  on the global mesh (each process's block holds a full copy), then each process keeps its own
  block. No host round trip."""
  pmesh = process_mesh(mesh)
  flat, treedef = jax.tree.flatten(tree)
  local = jax.tree.leaves(local_shardings)
  if len(local) != len(flat):
    raise ValueError(f"{len(flat)} arrays but {len(local)} shardings")
  target = tuple(NamedSharding(pmesh, s.spec) for s in local)
  if target not in _RESHARD:  # one resharding program per layout (once per run)
    _RESHARD[target] = jax.jit(_identity, out_shardings=list(target))
  moved = run_global(_RESHARD[target], flat)
  out = [jax.make_array_from_single_device_arrays(x.shape, s, [sh.data for sh in
                                                                y.addressable_shards])
         for x, s, y in zip(flat, local, moved)]
  return jax.tree.unflatten(treedef, out)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
