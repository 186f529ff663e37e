"""Tree (cascade) decode attention as a Pallas TPU (Mosaic) kernel.

Same contract as `reference.tree_attention_reference` (layout in `partials`' docstring): a
prefix phase stacks the queries of all branches of a group as the rows of one matmul against the
group's shared pages, a suffix phase runs each slot against its own pages, and the two partial
softmax results merge by log-sum-exp (`merge_partials`).

Both phases run one kernel, "rows against a paged sequence" (`paged_partials_tpu`):

- Page tables and lengths arrive by scalar prefetch (SMEM), so a program knows its page ids before
  any vector work and only visits key blocks that hold valid tokens.
- The KV pool stays in HBM (`pl.ANY`): a block of `pages_per_block` pages is copied by async DMA,
  one DMA per page, into a double-buffered VMEM scratch; the copy of block j+1 is issued before
  block j is computed, so the DMA overlaps the matmuls.
- Online softmax over the blocks: running max m and sum l live in VMEM scratch (lane-replicated,
  [rows, 128], the layout Mosaic keeps for per-row scalars), the unnormalized output accumulates in
  the output block itself.
- Grid (row group, KV head block, key split). A program's state lives entirely in the program (no
  DMA is carried across grid steps), so every axis may be marked parallel: on a two-core chip
  (v5p megacore) the cores split the row groups.

Block sizes and why:
- Rows: one program holds all rows of a group (B branches x G q heads, or G for a slot), padded to
  the sublane tile (8 rows f32, 16 bf16). Decode is bandwidth bound: padding rows cost MXU cycles
  that are idle anyway, never extra HBM traffic.
- KV heads per block (`kv_heads_per_block`, default: all local KV heads): one DMA per page moves the
  page's slice [page_size, heads, D]. With all heads it is the whole page (contiguous); under
  `shard_map` over `tensor` the local head count is small (1 or 2 for Qwen3 8 KV heads on 4-8 way
  tensor parallelism). Each head is then computed separately from the VMEM block, so no head pays
  for another's keys. A smaller block gives more programs but a strided DMA per page.
- Keys per block: `block_k` tokens (default 256) rounded to whole pages: big enough to amortize the
  per-step cost (~0.35 us) and DMA issue, small enough that the double buffer (2 x 2 x block_k x
  heads x D) fits the default scoped VMEM of every generation (16 MiB on v5e).
- Key splits (`num_splits`, default 1): TPU programs run one after another on one core, so splitting
  keys only adds a merge; it exists to balance the two cores of a megacore chip when there are too
  few row groups.

Page tables are flattened to 1-D for SMEM (2-D SMEM arrays pad their last dim to 128 words); a
table of S x P ids must fit SMEM (a few hundred KiB on current chips).

Imports only `partials`; `dispatch.tree_attention` picks this kernel on TPU and `sharded` runs it
under `shard_map`.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from trace_jax.kernels.partials import (MASK_VALUE, Partials, check_tree_args, group_rows,
                                        merge_partials, merge_split_partials, normalize_partials,
                                        prefix_partials_per_slot, resolve_scale, slot_rows)

DEFAULT_TPU_BLOCK_K = 256
LANES = 128  # per-row scalars (m, l) are kept lane-replicated


def interpret_params(**overrides):
  """TPU interpret mode settings for CPU tests: race detection on, fresh buffers full of NaN.

  Falls back to plain `interpret=True` on a jax without `pltpu.InterpretParams`.
  """
  if not hasattr(pltpu, "InterpretParams"):  # pragma: no cover
    return True
  kw = dict(detect_races=True, uninitialized_memory="nan")
  kw.update(overrides)
  return pltpu.InterpretParams(**kw)


def _sublane_rows(dtype) -> int:
  """Rows in one (sublane x lane) tile of `dtype`: 8 for 32-bit, 16 for bf16."""
  return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _paged_partials_tpu_kernel(
    # Scalar prefetch (SMEM).
    tables_ref,  # i32[N * P_pad]: row group i's page ids at [i * P_pad, (i + 1) * P_pad)
    lens_ref,  # i32[N]
    # Inputs.
    q_ref,  # [hb, M_pad, D] (VMEM block)
    k_hbm,  # [num_pages, page_size, Hkv, D] (HBM)
    v_hbm,
    # Outputs.
    o_ref,  # f32[hb, M_pad, D]: unnormalized sum_t exp(s_t - m) v_t
    ml_ref,  # f32[hb, M_pad, 128]: lane 0 m, lane 1 l
    # Scratch.
    k_buf,  # [2, ppb, page_size, hb, D] (VMEM)
    v_buf,
    sems,  # DMA semaphores [2 (k, v), 2 (buffer slot)]
    m_scr,  # f32[hb, M_pad, 128]
    l_scr,  # f32[hb, M_pad, 128]
    *,
    sm_scale: float,
    pages_per_block: int,
    pages_per_table: int,
    blocks_per_split: int,
    num_head_blocks: int,
):
  i, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  hb, m_pad, d = q_ref.shape
  page_size = k_buf.shape[2]
  block_k = pages_per_block * page_size
  length = lens_ref[i]
  first = c * blocks_per_split
  last = jnp.minimum(first + blocks_per_split, pl.cdiv(length, block_k))

  o_ref[...] = jnp.zeros_like(o_ref)
  m_scr[...] = jnp.full_like(m_scr, MASK_VALUE)
  l_scr[...] = jnp.zeros_like(l_scr)

  # All local heads: a static slice (Mosaic must prove head offsets tile aligned; a whole page is).
  heads = pl.ds(0, hb) if num_head_blocks == 1 else pl.ds(pl.multiple_of(h * hb, hb), hb)

  def block_copies(blk, slot):
    """The DMAs of key block `blk` into buffer `slot`: one per page, K and V."""
    copies = []
    for p in range(pages_per_block):
      page = tables_ref[i * pages_per_table + blk * pages_per_block + p]
      copies.append(pltpu.make_async_copy(
          k_hbm.at[page, :, heads, :], k_buf.at[slot, p], sems.at[0, slot]))
      copies.append(pltpu.make_async_copy(
          v_hbm.at[page, :, heads, :], v_buf.at[slot, p], sems.at[1, slot]))
    return copies

  @pl.when(first < last)
  def _():
    for cp in block_copies(first, 0):
      cp.start()

  def body(blk, slot):
    @pl.when(blk + 1 < last)
    def _():
      for cp in block_copies(blk + 1, 1 - slot):
        cp.start()

    for cp in block_copies(blk, slot):
      cp.wait()

    token = blk * block_k + lax.broadcasted_iota(jnp.int32, (m_pad, block_k), 1)
    valid = token < length
    # Tokens past the length come from real pages but may hold anything (stale or never written
    # KV); zero V there so a NaN cannot leak through p = 0.
    v_valid = (blk * block_k + lax.broadcasted_iota(jnp.int32, (block_k, d), 0)) < length
    for j in range(hb):
      q = q_ref[j]  # [M_pad, D]
      k = k_buf[slot, :, :, j, :].reshape(block_k, d)
      v = v_buf[slot, :, :, j, :].reshape(block_k, d)
      v = jnp.where(v_valid, v, jnp.zeros_like(v))
      s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
      s = jnp.where(valid, s * sm_scale, MASK_VALUE)
      # Every visited block holds a valid token, so m_new is a real logit and masked entries
      # underflow to exactly 0.
      m_prev = m_scr[j]  # [M_pad, 128]
      m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
      corr = jnp.exp(m_prev - m_new)
      p = jnp.exp(s - m_new[:, :1])
      l_scr[j] = corr * l_scr[j] + p.sum(axis=1, keepdims=True)
      m_scr[j] = m_new
      pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
      o_ref[j] = corr[:, :1] * o_ref[j] + pv
    return 1 - slot

  lax.fori_loop(first, jnp.maximum(first, last), body, jnp.int32(0))
  lane = lax.broadcasted_iota(jnp.int32, ml_ref.shape, 2)
  ml_ref[...] = jnp.where(lane == 0, m_scr[...], jnp.where(lane == 1, l_scr[...], 0.0))


def paged_partials_tpu(
    rows, k_pages, v_pages, tables, lens, sm_scale, *, block_k=DEFAULT_TPU_BLOCK_K,
    kv_heads_per_block=None, num_splits=1, interpret=False,
) -> Partials:
  """Rows against a paged sequence (TPU kernel); same contract as `paged_partials_reference`.

  Args:
    rows: [N, Hkv, M, D]; every row of n attends to the first lens[n] tokens of pages tables[n].
    k_pages, v_pages: [num_pages, page_size, Hkv, D].
    tables: i32[N, P] page ids (in range; ids past a row group's length are read and masked).
    lens: i32[N], 0 allowed (clipped to P * page_size).
    sm_scale: logit scale.
    block_k: keys per DMA block, rounded down to whole pages (at least one, at most P).
    kv_heads_per_block: KV heads per program (divides Hkv); default all.
    num_splits: key splits per table (see the module docstring).
    interpret: False, True or a `pltpu.InterpretParams` (CPU tests).

  Returns:
    Partials o f32[N, Hkv, M, D], m and l f32[N, Hkv, M].
  """
  n, hkv, m_rows, d = rows.shape
  page_size = k_pages.shape[1]
  p = tables.shape[1]
  hb = hkv if kv_heads_per_block is None else int(kv_heads_per_block)
  if hkv % hb:
    raise ValueError(f"kv_heads_per_block {hb} does not divide num_kv_heads {hkv}")
  packing = max(1, 4 // jnp.dtype(k_pages.dtype).itemsize)
  if hb != hkv and hb % packing:
    # Mosaic slices the pool's (heads, D) tiles only at tile-aligned head offsets; 16-bit pools
    # pack two heads per 32-bit sublane (checked by compiling for v5e/v5p/v6e).
    raise ValueError(f"kv_heads_per_block must be a multiple of {packing} for {k_pages.dtype} "
                     f"pools (or all {hkv} heads), got {hb}")
  m_pad = _round_up(max(m_rows, 1), _sublane_rows(rows.dtype))
  rows = jnp.pad(rows, ((0, 0), (0, 0), (0, m_pad - m_rows), (0, 0)))
  pages_per_block = max(1, min(block_k // page_size, p))
  p_pad = _round_up(p, pages_per_block)
  # Padding ids are 0 (in range); their tokens lie past lens and are masked.
  tables = jnp.pad(tables.astype(jnp.int32), ((0, 0), (0, p_pad - p))).reshape(-1)
  lens = jnp.clip(lens.astype(jnp.int32), 0, p * page_size)
  num_blocks = p_pad // pages_per_block
  blocks_per_split = pl.cdiv(num_blocks, max(1, min(int(num_splits), num_blocks)))
  splits = pl.cdiv(num_blocks, blocks_per_split)

  kernel = functools.partial(
      _paged_partials_tpu_kernel, sm_scale=float(sm_scale), pages_per_block=pages_per_block,
      pages_per_table=p_pad, blocks_per_split=blocks_per_split, num_head_blocks=hkv // hb,
  )
  buf = pltpu.VMEM((2, pages_per_block, page_size, hb, d), k_pages.dtype)
  acc = pltpu.VMEM((hb, m_pad, LANES), jnp.float32)
  o, ml = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(n, hkv // hb, splits),
          in_specs=[
              pl.BlockSpec((None, hb, m_pad, d), lambda i, h, c, *_: (i, h, 0, 0)),
              pl.BlockSpec(memory_space=pl.ANY),
              pl.BlockSpec(memory_space=pl.ANY),
          ],
          out_specs=[
              pl.BlockSpec((None, None, hb, m_pad, d), lambda i, h, c, *_: (c, i, h, 0, 0)),
              pl.BlockSpec((None, None, hb, m_pad, LANES), lambda i, h, c, *_: (c, i, h, 0, 0)),
          ],
          scratch_shapes=[buf, buf, pltpu.SemaphoreType.DMA((2, 2)), acc, acc],
      ),
      out_shape=[
          jax.ShapeDtypeStruct((splits, n, hkv, m_pad, d), jnp.float32),
          jax.ShapeDtypeStruct((splits, n, hkv, m_pad, LANES), jnp.float32),
      ],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel")
      ),
      interpret=interpret,
      name=f"tree_attention_tpu_ppb{pages_per_block}_hb{hb}_splits{splits}",
  )(tables, lens, rows, k_pages, v_pages)
  parts = Partials(o=o, m=ml[..., 0], l=ml[..., 1])
  merged = merge_split_partials(parts) if splits > 1 else Partials(*(x[0] for x in parts))
  return Partials(*(x[:, :, :m_rows] for x in merged))


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "block_k", "kv_heads_per_block", "num_splits", "interpret"),
)
def tree_attention_tpu(
    q, k_pages, v_pages, group_pages, group_lens, group_slots, suffix_pages, suffix_lens,
    *, sm_scale=None, block_k=DEFAULT_TPU_BLOCK_K, kv_heads_per_block=None, num_splits=1,
    interpret=False,
):
  """Tree decode attention with the Pallas TPU kernel (layout in `trace_jax.kernels.partials`).

  One kernel call per phase: the prefix phase with all branch queries of a group stacked as rows,
  the suffix phase with one slot per row group; the phases merge by log-sum-exp in jnp.
  Keyword arguments are those of `paged_partials_tpu`. Returns [S, Hq, D] in q.dtype.
  """
  check_tree_args(q, k_pages, v_pages, group_pages, group_lens, group_slots, suffix_pages,
                  suffix_lens)
  s, hq, d = q.shape
  hkv = k_pages.shape[2]
  run = functools.partial(
      paged_partials_tpu, sm_scale=resolve_scale(d, sm_scale), block_k=block_k,
      kv_heads_per_block=kv_heads_per_block, num_splits=num_splits, interpret=interpret,
  )
  prefix = run(group_rows(q, group_slots, hkv), k_pages, v_pages, group_pages, group_lens)
  prefix = prefix_partials_per_slot(prefix, group_slots, s)
  suffix = run(slot_rows(q, hkv), k_pages, v_pages, suffix_pages, suffix_lens)
  out = normalize_partials(merge_partials(prefix, suffix))
  return out.reshape(s, hq, d).astype(q.dtype)
