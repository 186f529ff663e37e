"""Tree decode attention on a mesh: rows (slots, groups, pages) over data, KV heads over tensor.

A `pallas_call` inside a sharded jit has no partitioning rule, so XLA would all-gather its operands
(the whole KV pool) onto every device. `tree_attention_sharded` runs the chosen implementation
under `shard_map` instead: each device sees its own data shard's slots, groups and page range and
its tensor shard's KV heads, and nothing is gathered.

Contract (global arrays, shapes as in `tree_attention`):
- q [S, Hq, D], suffix tables/lens and the group arrays are split along their leading axis over
  `data_axes`; the pool [num_pages, page_size, Hkv, D] is split over `data_axes` on pages and over
  `head_axis` on KV heads (q heads alike). A tree lives on one data shard: a group's slots and all
  pages a row group reads belong to its own shard.
- Page ids and slot ids are global; they become shard-local inside (minus the shard's offset).
- A head axis that does not divide Hkv is left out (heads replicated), as the sharding rules do.

Imports only `dispatch`: `impl` picks the backend run on each shard, as in `tree_attention`.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from trace_jax.kernels.dispatch import tree_attention


def tree_attention_sharded(
    q, k_pages, v_pages, group_pages, group_lens, group_slots, suffix_pages, suffix_lens,
    *, mesh, data_axes=("data",), head_axis="tensor", sm_scale=None, impl="auto",
):
  """`tree_attention` under `shard_map` on `mesh` (contract in the module docstring)."""
  data_axes = tuple(data_axes)
  hkv = k_pages.shape[2]
  heads = head_axis if head_axis and hkv % mesh.shape[head_axis] == 0 else None
  rows = data_axes or None
  num_shards = 1
  for a in data_axes:
    num_shards *= mesh.shape[a]
  for name, x in (("q", q), ("k_pages", k_pages), ("group_pages", group_pages)):
    if x.shape[0] % num_shards:
      raise ValueError(f"{name} leading dim {x.shape[0]} does not split over {num_shards} shards")
  local_pages = k_pages.shape[0] // num_shards
  local_slots = q.shape[0] // num_shards

  def local(q, k, v, gp, gl, gs, sp, sl):
    shard = lax.axis_index(data_axes) if data_axes else 0
    gp = gp - shard * local_pages
    sp = sp - shard * local_pages
    gs = jnp.where(gs >= 0, gs - shard * local_slots, -1)
    return tree_attention(q, k, v, gp, gl, gs, sp, sl, sm_scale=sm_scale, impl=impl)

  pool = P(rows, None, heads, None)
  in_specs = (P(rows, heads, None), pool, pool, P(rows, None), P(rows), P(rows, None),
              P(rows, None), P(rows))
  fn = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P(rows, heads, None),
                     check_vma=False)
  return fn(q, k_pages, v_pages, group_pages, group_lens, group_slots, suffix_pages, suffix_lens)
