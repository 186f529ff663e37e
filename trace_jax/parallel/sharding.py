"""Mesh construction and logical-axis sharding rules.

Parameters carry logical axis names (`nnx.Param(..., logical_axes=("embed", "mlp"))`); the rules
below map each logical name to mesh axes. A dimension that a mesh axis does not divide is left
replicated rather than failing (e.g. 2 KV heads on a tensor axis of 4), and `describe_fallbacks`
says where that happened.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# logical name -> mesh axis (or tuple of axes, or None for replicated)
DEFAULT_RULES: tuple[tuple[str, object], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
    ("seq", None),
    ("pages", None),
    ("predictor_hidden", None),
    ("lora_rank", None),  # LoRA adapters' rank dimension (models.lora): small, replicated
)


def parse_mesh_spec(spec: str | Mapping[str, int] | None) -> dict[str, int]:
  """'data:2,fsdp:4,tensor:1' (or a dict) -> {'data': 2, 'fsdp': 4, 'tensor': 1}."""
  if spec is None or spec == "":
    return {"data": -1, "fsdp": 1, "tensor": 1}
  if isinstance(spec, str):
    out = {}
    for part in spec.split(","):
      name, _, size = part.partition(":")
      name = name.strip()
      if name not in MESH_AXES:
        raise ValueError(f"unknown mesh axis {name!r} in {spec!r}; axes are {MESH_AXES}")
      try:
        out[name] = int(size)
      except ValueError:
        raise ValueError(f"mesh axis {name!r} needs an integer size, got {size!r}") from None
    spec = out
  spec = dict(spec)
  for name in spec:
    if name not in MESH_AXES:
      raise ValueError(f"unknown mesh axis {name!r}; axes are {MESH_AXES}")
  return {a: int(spec.get(a, 1)) for a in MESH_AXES}


def make_mesh(spec=None, devices: Sequence | None = None) -> Mesh:
  """Builds a (data, fsdp, tensor) mesh. One axis may be -1 (takes the remaining devices).

  Raises a ValueError naming the axes when their product does not match the device count.
  """
  devices = list(devices if devices is not None else jax.devices())
  sizes = parse_mesh_spec(spec)
  n = len(devices)
  free = [a for a, s in sizes.items() if s == -1]
  if len(free) > 1:
    raise ValueError(f"at most one mesh axis may be -1, got {free}")
  fixed = math.prod(s for s in sizes.values() if s != -1)
  if any(s == 0 or s < -1 for s in sizes.values()):
    raise ValueError(f"mesh axis sizes must be positive (or -1): {sizes}")
  if free:
    if n % fixed:
      raise ValueError(f"mesh axes {sizes} do not divide the {n} devices")
    sizes[free[0]] = n // fixed
  if math.prod(sizes.values()) != n:
    raise ValueError(f"mesh axes {sizes} need {math.prod(sizes.values())} devices, found {n}")
  arr = np.asarray(devices, dtype=object).reshape(tuple(sizes[a] for a in MESH_AXES))
  return Mesh(arr, MESH_AXES)


def _axis_size(mesh: Mesh, axes) -> int:
  if axes is None:
    return 1
  axes = (axes,) if isinstance(axes, str) else tuple(axes)
  return math.prod(mesh.shape[a] for a in axes)


def logical_to_spec(logical_axes: Sequence[str | None] | None, rules=DEFAULT_RULES,
                    mesh: Mesh | None = None, shape: Sequence[int] | None = None) -> P:
  """Maps logical axis names to a PartitionSpec; drops mesh axes that do not divide `shape`
  or that are already used by an earlier dimension."""
  if not logical_axes:
    return P()
  rules = dict(rules)
  used, out = set(), []
  for i, name in enumerate(logical_axes):
    if name is not None and name not in rules:
      raise KeyError(f"logical axis {name!r} has no sharding rule; known: {sorted(rules)}")
    axes = rules.get(name) if name is not None else None
    if axes is not None:
      tup = (axes,) if isinstance(axes, str) else tuple(axes)
      if mesh is not None:
        tup = tuple(a for a in tup if mesh.shape[a] > 1)  # size-1 axes add nothing
      tup = tuple(a for a in tup if a not in used)
      if mesh is not None and shape is not None and tup and shape[i] % _axis_size(mesh, tup):
        tup = ()
      used.update(tup)
      axes = None if not tup else (tup[0] if len(tup) == 1 else tup)
    out.append(axes)
  while out and out[-1] is None:
    out.pop()
  return P(*out)


def variable_value(v):
  """The raw value of an nnx Variable, concrete array or abstract ShapeDtypeStruct alike."""
  return v.get_value() if hasattr(v, "get_value") else v.value


def set_variable_value(v, value) -> None:
  """Set an nnx Variable's raw value in place (older flax has only the `.value` setter, newer
  flax deprecates it for `set_value`)."""
  if hasattr(v, "set_value"):
    v.set_value(value)
  else:
    v.value = value


def _is_var(x):
  return isinstance(x, nnx.Variable)


def state_specs(state, mesh: Mesh | None = None, rules=DEFAULT_RULES):
  """PartitionSpec for every Variable of an nnx State (abstract or concrete), same structure."""
  def spec(v):
    axes = getattr(v, "logical_axes", None)
    shape = getattr(variable_value(v), "shape", None)
    return logical_to_spec(axes, rules, mesh, shape)
  return jax.tree.map(lambda v: spec(v), state, is_leaf=_is_var)


def state_shardings(state, mesh: Mesh, rules=DEFAULT_RULES):
  """NamedSharding for every Variable of an nnx State, as a State of the same structure."""
  specs = state_specs(state, mesh, rules)
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda x: isinstance(x, P))


def shard_state(state, mesh: Mesh, rules=DEFAULT_RULES):
  """Places every array of an nnx State in its logical sharding."""
  from trace_jax.parallel.distributed import put_global  # (multi-process meshes too)
  sh = state_shardings(state, mesh, rules)
  return jax.tree.map(lambda v, s: v.replace(put_global(variable_value(v), s)), state, sh,
                      is_leaf=_is_var)


def batch_sharding(mesh: Mesh, ndim: int, rules=DEFAULT_RULES) -> NamedSharding:
  """Shards the leading (batch) dimension over the batch mesh axes; the rest replicated."""
  return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), rules, mesh))


def shard_batch(batch, mesh: Mesh, rules=DEFAULT_RULES):
  """device_put a pytree of host arrays with the batch dimension sharded; checks divisibility."""
  n = _axis_size(mesh, dict(rules)["batch"])

  def put(x):
    x = np.asarray(x)
    if x.ndim and x.shape[0] % n:
      raise ValueError(f"batch dimension {x.shape[0]} is not divisible by the {n} devices of the "
                       f"batch mesh axes {dict(rules)['batch']}")
    return put_global(x, batch_sharding(mesh, max(x.ndim, 1), rules))
  from trace_jax.parallel.distributed import put_global  # (multi-process meshes too)
  return jax.tree.map(put, batch)


def describe_fallbacks(state, mesh: Mesh, rules=DEFAULT_RULES) -> list[str]:
  """Parameters whose logical rule could not be applied because the mesh axis does not divide."""
  out = []
  flat = nnx.to_flat_state(state) if hasattr(nnx, "to_flat_state") else state.flat_state()
  for path, v in flat:
    axes = getattr(v, "logical_axes", None) or ()
    shape = variable_value(v).shape
    wanted = logical_to_spec(axes, rules, mesh)
    got = logical_to_spec(axes, rules, mesh, shape)
    if wanted != got:
      out.append(f"{'/'.join(map(str, path))}: {tuple(shape)} wanted {wanted}, got {got}")
  return out
