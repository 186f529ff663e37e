"""Micro-batches that keep the batch rows split over the data-parallel mesh axes.

A batch `[B, ...]` placed with `shard_batch` holds rows in contiguous blocks, one block per shard of
the batch mesh axes (data, fsdp). A plain `reshape(n_micro, B / n_micro, ...)` would put that split
on the micro-batch index: each micro-batch would live on a subset of the devices and every device
would gather and multiply a whole micro-batch. Here each shard's block is cut into `n_micro`
pieces and micro-batch m takes piece m of every shard, so it stays split over all row shards and
each device multiplies B / (shards x n_micro) rows per micro-batch.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from trace_jax.parallel.sharding import DEFAULT_RULES, logical_to_spec


def row_axes(mesh: Mesh | None, rules=DEFAULT_RULES):
  """The mesh axes (size > 1) that split the batch rows, as one PartitionSpec entry (or None)."""
  if mesh is None:
    return None
  spec = logical_to_spec(("batch",), rules, mesh)
  return spec[0] if len(spec) else None


def row_shards(mesh: Mesh | None, rules=DEFAULT_RULES) -> int:
  """How many blocks the batch rows are split into (data x fsdp with the default rules)."""
  axes = row_axes(mesh, rules)
  if axes is None:
    return 1
  axes = (axes,) if isinstance(axes, str) else axes
  return math.prod(mesh.shape[a] for a in axes)


def padded_rows(rows: int, micro_batches: int, shards: int) -> int:
  """`rows` rounded up to a multiple of micro_batches x shards (at least one of each), so every
  micro-batch splits evenly over the row shards; the extra rows are padding (loss mask zero) and
  still cost their compute and memory. 512 rows, 32 micro-batches, 64 shards -> 2048."""
  m = int(micro_batches) * int(shards)
  return max(m, -(-int(rows) // m) * m)


def _constrain(x, mesh, spec):
  if mesh is None:
    return x
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def split_micro_batches(batch, n_micro: int, mesh: Mesh | None = None, rules=DEFAULT_RULES):
  """Pytree of `[B, ...]` -> `[n_micro, B / n_micro, ...]`, every micro-batch split over the rows'
  mesh axes (see the module docstring). Without a mesh it is `reshape(n_micro, B / n_micro)`.

  Raises ValueError when B is not a multiple of shards x n_micro.
  """
  if n_micro < 1:
    raise ValueError(f"micro_batches must be >= 1, got {n_micro}")
  s = row_shards(mesh, rules)
  axes = row_axes(mesh, rules)

  def one(x):
    b = x.shape[0]
    if b % (s * n_micro):
      raise ValueError(f"batch size {b} is not divisible by micro_batches={n_micro} x {s} row "
                       f"shards of the mesh")
    r = b // (s * n_micro)
    rest = x.shape[1:]
    y = x.reshape((s, n_micro, r) + rest).swapaxes(0, 1).reshape((n_micro, s * r) + rest)
    return _constrain(y, mesh, P(None, axes))
  return jax.tree.map(one, batch)


def merge_micro_batches(tree, mesh: Mesh | None = None, rules=DEFAULT_RULES):
  """Inverse of `split_micro_batches`: `[n_micro, B / n_micro, ...]` -> `[B, ...]` in the original
  row order, split over the rows' mesh axes."""
  s = row_shards(mesh, rules)
  axes = row_axes(mesh, rules)

  def one(y):
    n_micro, rows = y.shape[:2]
    rest = y.shape[2:]
    x = y.reshape((n_micro, s, rows // s) + rest).swapaxes(0, 1)
    return _constrain(x.reshape((n_micro * rows,) + rest), mesh, P(axes))
  return jax.tree.map(one, tree)
