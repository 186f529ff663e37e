"""Multi-controller runs: one process per host, `jax.distributed` as the engine.

`initialize` joins the processes. The helpers below are what a training loop needs around a
global mesh: host objects gathered from every process (`allgather_object`), arrays moved between a
process's own devices and the global mesh (`put_global`, `fetch`, `to_local`), and the block of the
mesh a process owns (`local_mesh`). With one process each helper is the identity or its plain
single-process counterpart.

Host objects travel as data, never as pickles (a pickle from a peer runs whatever code it names):
`encode_object` / `decode_object` write a JSON header followed by raw array bytes, and round-trip
exactly None, bool, int, float, str, bytes, list, tuple, dict (any encodable keys, order kept),
numpy arrays and scalars of numeric dtypes (bfloat16 included), and instances of the data classes
registered with `register_wire_type` (rollout `Tree`s and their `Node`s are known by name); the
sender refuses anything else with a TypeError, the receiver any other type name with a ValueError.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import struct
import sys

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


# ---- the wire format of host objects: a JSON header, then raw buffers (never pickle) ----------
_MAGIC = b"TJW1"
# Data classes known by name without registration (the rollout trees `ProcessShardedEngine`
# gathers). The receiver only looks them up among modules it has already imported.
_KNOWN_TYPES = ("trace_jax.sampling.tree.Tree", "trace_jax.sampling.tree.Node")
_WIRE_TYPES: dict[str, type] = {}


def register_wire_type(cls: type) -> type:
  """Lets instances of the data class `cls` travel through `allgather_object` and its kin: its
  instance `__dict__` is sent (every value encodable) and set on a new instance without calling
  `__init__` on the receiving side. Usable as a class decorator."""
  if not isinstance(cls, type) or "__slots__" in vars(cls):
    raise TypeError(f"register_wire_type needs a class whose instances have a __dict__, "
                    f"got {cls!r}")
  _WIRE_TYPES[_type_name(cls)] = cls
  return cls


def _type_name(cls: type) -> str:
  return f"{cls.__module__}.{cls.__qualname__}"


def _wire_type(name: str) -> type | None:
  if name in _WIRE_TYPES:
    return _WIRE_TYPES[name]
  if name in _KNOWN_TYPES:
    module, _, qualname = name.rpartition(".")
    cls = getattr(sys.modules.get(module), qualname, None)
    return cls if isinstance(cls, type) else None
  return None


@functools.cache
def _wire_dtypes() -> dict:
  """The dtypes arrays may have on the wire, by name."""
  names = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
           "float16", "float32", "float64", "complex64", "complex128"]
  out = {n: np.dtype(n) for n in names}
  import ml_dtypes  # (installed with jax)
  for n in ("bfloat16", "float8_e4m3fn", "float8_e5m2", "int4", "uint4"):
    if hasattr(ml_dtypes, n):
      out[n] = np.dtype(getattr(ml_dtypes, n))
  return out


def encode_object(obj) -> bytes:
  """`obj` as bytes for a peer (see the module docstring for the types); TypeError naming the
  first value of another type."""
  buffers: list[bytes] = []
  header = json.dumps({"v": _encode(obj, buffers), "b": [len(b) for b in buffers]},
                      separators=(",", ":")).encode("utf-8")
  return b"".join([_MAGIC, struct.pack("<Q", len(header)), header, *buffers])


def decode_object(blob: bytes):
  """The value `encode_object` wrote; ValueError for anything malformed (never runs code)."""
  blob = bytes(blob)
  if blob[:4] != _MAGIC or len(blob) < 12:
    raise ValueError("not an encoded host object (a peer of another version, or corrupt data)")
  (n,) = struct.unpack("<Q", blob[4:12])
  try:
    header = json.loads(blob[12:12 + n].decode("utf-8"))
    sizes = header["b"]
    if not isinstance(sizes, list) or not all(type(x) is int and x >= 0 for x in sizes):
      raise ValueError("bad buffer table")
    offsets = list(itertools.accumulate(sizes, initial=12 + n))
    if offsets[-1] != len(blob):
      raise ValueError(f"{len(blob)} bytes, the header describes {offsets[-1]}")
    buffers = [blob[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
    return _decode(header["v"], buffers)
  except (KeyError, TypeError, IndexError, AttributeError, RecursionError,
          UnicodeDecodeError) as e:
    raise ValueError(f"malformed host object: {type(e).__name__}: {e}") from None


_SCALARS = frozenset({type(None), bool, int, float, str})


def _encode(x, buffers: list):
  t = type(x)
  if t in _SCALARS:
    return x
  if t is list:
    return x if all(type(v) in _SCALARS for v in x) else [_encode(v, buffers) for v in x]
  if t is tuple:
    return {"$": "tuple", "v": _encode(list(x), buffers)}
  if t is dict:
    if all(type(k) is str for k in x):
      return {"$": "dict", "d": {k: _encode(v, buffers) for k, v in x.items()}}
    return {"$": "dict", "k": _encode(list(x), buffers), "v": _encode(list(x.values()), buffers)}
  if t is bytes:
    buffers.append(x)
    return {"$": "bytes", "b": len(buffers) - 1}
  if t is np.ndarray or isinstance(x, np.generic):
    arr = np.asarray(x)
    if arr.dtype.name not in _wire_dtypes():
      raise TypeError(f"numpy dtype {arr.dtype} cannot be sent to other processes (numeric "
                      f"dtypes only)")
    if arr.dtype.byteorder == ">":
      arr = arr.astype(arr.dtype.newbyteorder("="))
    buffers.append(np.ascontiguousarray(arr).tobytes())
    return {"$": "nd" if t is np.ndarray else "np", "dtype": arr.dtype.name,
            "shape": list(arr.shape), "b": len(buffers) - 1}
  name = _type_name(t)
  if _wire_type(name) is t and hasattr(x, "__dict__"):
    return {"$": "obj", "type": name, "state": _encode(dict(vars(x)), buffers)}
  raise TypeError(f"a {name} cannot be sent to other processes; send plain data (None, bool, "
                  f"int, float, str, bytes, list, tuple, dict, numpy arrays) or register its "
                  f"class with trace_jax.parallel.distributed.register_wire_type")


def _decode(x, buffers: list):
  if type(x) in _SCALARS:
    return x
  if type(x) is list:
    return x if all(type(v) in _SCALARS for v in x) else [_decode(v, buffers) for v in x]
  if type(x) is not dict:
    raise ValueError(f"unexpected {type(x).__name__} in a host object")
  tag = x.get("$")
  if tag == "tuple":
    return tuple(_decode_list(x["v"], buffers))
  if tag == "dict":
    if "d" in x:
      if type(x["d"]) is not dict:
        raise ValueError("a dict without its items")
      return {k: _decode(v, buffers) for k, v in x["d"].items()}
    keys, values = _decode_list(x["k"], buffers), _decode_list(x["v"], buffers)
    if len(keys) != len(values):
      raise ValueError("a dict with more keys than values")
    return dict(zip(keys, values))
  if tag == "bytes":
    return _buffer(buffers, x["b"])
  if tag in ("nd", "np"):
    dtype = _wire_dtypes().get(x["dtype"])
    shape = x["shape"]
    if dtype is None or not all(type(d) is int and d >= 0 for d in shape):
      raise ValueError(f"bad array header: dtype {x['dtype']!r}, shape {shape!r}")
    data = _buffer(buffers, x["b"])
    if len(data) != math.prod(shape) * dtype.itemsize:
      raise ValueError(f"array of shape {shape} and dtype {dtype} with {len(data)} bytes")
    arr = np.frombuffer(data, dtype).reshape(shape).copy()
    return arr if tag == "nd" else arr[()]
  if tag == "obj":
    cls = _wire_type(x["type"]) if isinstance(x["type"], str) else None
    if cls is None:
      raise ValueError(f"type {str(x['type'])[:100]!r} is not one this process accepts")
    state = _decode(x["state"], buffers)
    if type(state) is not dict or not all(type(k) is str for k in state):
      raise ValueError(f"bad state for {x['type']}")
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj
  raise ValueError(f"unknown tag {str(tag)[:50]!r} in a host object")


def _decode_list(x, buffers: list) -> list:
  if type(x) is not list:
    raise ValueError(f"expected a list in a host object, got {type(x).__name__}")
  return _decode(x, buffers)


def _buffer(buffers: list, i) -> bytes:
  if type(i) is not int or not 0 <= i < len(buffers):
    raise ValueError(f"bad buffer index {str(i)[:20]}")
  return buffers[i]


def allgather_object(obj) -> list:
  """Every process's `obj` (of a type `encode_object` takes, else a TypeError before anything is
  sent), in process order, on every process. A collective: every process must call it, in the
  same order (it waits for the others, up to the gather timeout). With one process: `[obj]`."""
  if jax.process_count() == 1:
    return [obj]
  client, rank, n = _client(), jax.process_index(), jax.process_count()
  seq = _seq["gather"]
  _seq["gather"] += 1
  blob = encode_object(obj)
  chunks = [blob[i:i + _CHUNK] for i in range(0, len(blob), _CHUNK)] or [b""]
  base = f"trace_jax/gather/{seq}"
  for i, c in enumerate(chunks):
    client.key_value_set_bytes(f"{base}/{rank}/{i}", c)
  client.key_value_set(f"{base}/{rank}/n", str(len(chunks)))
  out = []
  for p in range(n):
    k = int(client.blocking_key_value_get(f"{base}/{p}/n", _timeout_ms()))
    out.append(decode_object(b"".join(client.blocking_key_value_get_bytes(f"{base}/{p}/{i}",
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
  their numpy values; the pytree's structure is each process's own, its leaves must match process
  0's in number, shape and dtype)."""
  if jax.process_count() == 1:
    return tree
  import jax.numpy as jnp
  leaves, treedef = jax.tree.flatten(tree)
  mine = [np.asarray(x) for x in leaves]
  values = broadcast_object(mine)
  if type(values) is not list or len(values) != len(mine) or not all(
      type(v) is np.ndarray and (v.shape, v.dtype) == (x.shape, x.dtype)
      for v, x in zip(values, mine)):
    raise RuntimeError("broadcast_arrays: process 0's arrays differ from this process's in "
                       "number, shape or dtype")
  return jax.tree.unflatten(treedef, [jnp.asarray(v) for v in values])


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
