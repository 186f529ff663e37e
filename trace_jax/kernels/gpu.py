"""Tree decode attention as a Triton-style Pallas kernel for GPU (also runnable in interpret mode).

Same contract as `reference.tree_attention_reference` (layout in `partials`). One kernel,
"rows against a paged sequence" (`_paged_partials_pallas`, the Pallas twin of
`reference.paged_partials_reference`), runs both phases: the prefix phase with all branch queries
of a group stacked as the matmul rows, the suffix phase with one slot per row group. Key-split,
prefix and suffix partials merge by log-sum-exp in jnp (`partials`).

Block sizes and the reasons for them are in the comment above the kernel. On TPU this kernel does
not lower (see that comment); `tpu.tree_attention_tpu` is the Mosaic version, and
`dispatch.tree_attention` picks between them. Imports only `partials`.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # Present in GPU-capable jax builds; only needed to pick the Triton lowering on GPU.
  from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover
  pltriton = None

from trace_jax.kernels.partials import (MASK_VALUE, Partials, check_tree_args, group_rows,
                                        merge_partials, merge_split_partials, normalize_partials,
                                        prefix_partials_per_slot, resolve_scale, slot_rows)


# ---------------------------------------------------------------------------------------------
# Pallas kernel (GPU / Triton lowering; interpret mode on CPU).
#
# Block sizes and why:
# - Rows (M): the prefix phase stacks B branches x G q heads per kv head as matmul rows. Triton
#   tiles need power-of-two shapes and tensor-core dots need M >= 16, so rows are padded to
#   max(16, next_pow2(B*G)), capped at block_m = 64 per program: a [64, D] f32 accumulator fits in
#   registers, and larger trees get more programs along a third grid axis (their re-reads of the
#   same prefix pages hit L2). The suffix phase has only G rows per slot, also padded to 16: decode
#   is bandwidth bound, so the idle rows cost no extra KV traffic.
# - Keys (N): pages_per_block pages of page_size tokens are gathered per loop step, default
#   block_k = pages_per_block * page_size = 64 tokens (4 pages of 16): big enough for efficient dots
#   and memory transactions, small enough that masking waste on the last partial block is bounded.
# - Key splits (flash-decoding): a tree step has few groups, so (group, kv head, row block) alone
#   gives a handful of programs for a long shared prefix (1 group x 8 kv heads = 8 of ~132 SMs).
#   The key blocks of a table are split over a fourth grid axis, enough splits to reach about
#   TARGET_PROGRAMS programs (twice the SM count of current data-center GPUs); split partials merge
#   by log-sum-exp in jnp. The suffix phase has one program per slot and usually needs no split.
# - num_warps=4, num_stages=2: a small M tile; two stages overlap the next block's page gather.
# Page tables are plain int arrays indexed in the kernel (no scalar prefetch, which Triton lacks);
# one program per (group or slot, kv head, row block) loops only over its valid key blocks.
#
# On TPU (Mosaic) this kernel does not lower as is: gathers by a vector of page ids from a ref in
# HBM are not supported there. The TPU version (tpu.py) passes the page tables and
# lengths via scalar prefetch, keeps the pool in pl.ANY memory and DMAs pages into a
# double-buffered VMEM scratch; the dispatcher picks it on TPU.
# ---------------------------------------------------------------------------------------------

DEFAULT_BLOCK_K = 64
MAX_BLOCK_M = 64
MIN_BLOCK_M = 16
TARGET_PROGRAMS = 256


def _paged_partials_kernel(
    tables_ref,  # i32[P_pad]: this row group's page table
    lens_ref,  # i32[1]: its valid token count
    q_ref,  # [block_m, D]
    k_ref,  # [num_pages, page_size, D] (this kv head)
    v_ref,  # [num_pages, page_size, D]
    o_ref,  # f32[block_m, D]  (this key split's partial)
    m_ref,  # f32[block_m]
    l_ref,  # f32[block_m]
    *,
    sm_scale: float,
    pages_per_block: int,
    blocks_per_split: int,
):
  block_m, d = q_ref.shape
  page_size = k_ref.shape[1]
  block_k = pages_per_block * page_size
  length = lens_ref[0]
  q = q_ref[...]
  token = jnp.arange(block_k, dtype=jnp.int32)

  def body(i, carry):
    o, m, l = carry
    pages = tables_ref[pl.ds(i * pages_per_block, pages_per_block)]
    k = k_ref[pages].reshape(block_k, d)
    v = v_ref[pages].reshape(block_k, d)
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * sm_scale  # [block_m, block_k]
    valid = (i * block_k + token) < length
    s = jnp.where(valid[None, :], s, MASK_VALUE)
    # Every visited block holds at least one valid token, so m_new is a real logit and the masked
    # entries underflow to exactly 0.
    m_new = jnp.maximum(m, s.max(axis=-1))
    corr = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    l = corr * l + p.sum(axis=-1)
    o = corr[:, None] * o + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o, m_new, l

  init = (
      jnp.zeros((block_m, d), jnp.float32),
      jnp.full((block_m,), MASK_VALUE, jnp.float32),
      jnp.zeros((block_m,), jnp.float32),
  )
  # This program's share of the key blocks, cut at the last block holding a valid token.
  first = pl.program_id(3) * blocks_per_split
  last = jnp.minimum(first + blocks_per_split, pl.cdiv(length, block_k))
  o, m, l = lax.fori_loop(first, jnp.maximum(first, last), body, init)
  o_ref[...] = o
  m_ref[...] = m
  l_ref[...] = l


def _next_pow2(x: int) -> int:
  return 1 << max(0, (x - 1).bit_length())


def _prev_pow2(x: int) -> int:
  return 1 << max(0, x.bit_length() - 1)


def _paged_partials_pallas(
    rows, k_pages, v_pages, tables, lens, sm_scale, *, block_k, block_m, num_splits, num_warps,
    num_stages, interpret,
) -> Partials:
  """Pallas version of `reference.paged_partials_reference` (same shapes and semantics).

  rows [N, Hkv, M, D], tables i32[N, P], lens i32[N] -> f32 Partials o [N, Hkv, M, D], m and l
  [N, Hkv, M]; the keyword arguments as in `tree_attention_pallas`.
  """
  n, hkv, m_rows, d = rows.shape
  num_pages, page_size, _, _ = k_pages.shape
  p = tables.shape[1]

  bm = block_m or min(MAX_BLOCK_M, max(MIN_BLOCK_M, _next_pow2(m_rows)))
  m_pad = pl.cdiv(m_rows, bm) * bm
  rows = jnp.pad(rows, ((0, 0), (0, 0), (0, m_pad - m_rows), (0, 0)))
  # Powers of two (Triton tiles); no more pages per step than a short table needs.
  pages_per_block = min(_prev_pow2(max(1, block_k // page_size)), _next_pow2(p))
  p_pad = max(pages_per_block, pl.cdiv(p, pages_per_block) * pages_per_block)
  # Padding page ids are 0 (in range); their tokens lie past lens and are masked.
  tables = jnp.pad(tables.astype(jnp.int32), ((0, 0), (0, p_pad - p)))
  lens = jnp.minimum(lens.astype(jnp.int32), p * page_size)
  num_blocks = p_pad // pages_per_block
  programs = n * hkv * (m_pad // bm)
  splits = num_splits or max(1, TARGET_PROGRAMS // max(programs, 1))
  blocks_per_split = pl.cdiv(num_blocks, max(1, min(splits, num_blocks)))
  splits = pl.cdiv(num_blocks, blocks_per_split)  # no split without key blocks

  kernel = functools.partial(
      _paged_partials_kernel, sm_scale=sm_scale, pages_per_block=pages_per_block,
      blocks_per_split=blocks_per_split,
  )
  compiler_params = None
  if pltriton is not None and not interpret:
    compiler_params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
  # Grid (row group i, kv head h, row block j, key split c).
  pool_spec = pl.BlockSpec((num_pages, page_size, None, d), lambda i, h, j, c: (0, 0, h, 0))
  o, m, l = pl.pallas_call(
      kernel,
      grid=(n, hkv, m_pad // bm, splits),
      in_specs=[
          pl.BlockSpec((None, p_pad), lambda i, h, j, c: (i, 0)),
          pl.BlockSpec((1,), lambda i, h, j, c: (i,)),
          pl.BlockSpec((None, None, bm, d), lambda i, h, j, c: (i, h, j, 0)),
          pool_spec,
          pool_spec,
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, bm, d), lambda i, h, j, c: (c, i, h, j, 0)),
          pl.BlockSpec((None, None, None, bm), lambda i, h, j, c: (c, i, h, j)),
          pl.BlockSpec((None, None, None, bm), lambda i, h, j, c: (c, i, h, j)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((splits, n, hkv, m_pad, d), jnp.float32),
          jax.ShapeDtypeStruct((splits, n, hkv, m_pad), jnp.float32),
          jax.ShapeDtypeStruct((splits, n, hkv, m_pad), jnp.float32),
      ],
      compiler_params=compiler_params,
      interpret=interpret,
      name=f"tree_attention_paged_partials_bm{bm}_ppb{pages_per_block}_splits{splits}",
  )(tables, lens, rows, k_pages, v_pages)
  merged = merge_split_partials(Partials(o=o, m=m, l=l))
  return Partials(*(x[:, :, :m_rows] for x in merged))


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale", "block_k", "block_m", "num_splits", "num_warps", "num_stages", "interpret"
    ),
)
def tree_attention_pallas(
    q, k_pages, v_pages, group_pages, group_lens, group_slots, suffix_pages, suffix_lens,
    *, sm_scale=None, block_k=DEFAULT_BLOCK_K, block_m=None, num_splits=None, num_warps=4,
    num_stages=2, interpret=False,
):
  """Tree decode attention with Pallas kernels (layout in `trace_jax.kernels.partials`).

  The prefix kernel runs one program per (group, kv head, row block, key split) with all branch
  queries of the group stacked as the matmul rows; the suffix kernel is the same kernel with one
  slot per row group. Partials (splits, then prefix and suffix) merge by log-sum-exp in jnp.

  Args:
    block_k: keys per loop step, rounded down to whole pages (default 64 tokens).
    block_m: rows per program; default min(64, max(16, next_pow2(rows))).
    num_splits: key splits per table (both phases); default: enough to reach ~TARGET_PROGRAMS
      programs, at most one per key block.
    num_warps, num_stages: Triton launch parameters (ignored in interpret mode).
    interpret: run the kernels with the Pallas interpreter (CPU tests).

  GPU (Triton) needs page_size, D and block sizes to be powers of two. See the comment above the
  kernel for what the TPU version (tpu.py) does differently.

  Returns:
    [S, Hq, D] in q.dtype.
  """
  check_tree_args(q, k_pages, v_pages, group_pages, group_lens, group_slots, suffix_pages,
                  suffix_lens)
  s, hq, d = q.shape
  hkv = k_pages.shape[2]
  scale = resolve_scale(d, sm_scale)
  run = functools.partial(
      _paged_partials_pallas, sm_scale=scale, block_k=block_k, block_m=block_m,
      num_splits=num_splits, num_warps=num_warps, num_stages=num_stages, interpret=interpret,
  )
  prefix = run(group_rows(q, group_slots, hkv), k_pages, v_pages, group_pages, group_lens)
  prefix = prefix_partials_per_slot(prefix, group_slots, s)
  suffix = run(slot_rows(q, hkv), k_pages, v_pages, suffix_pages, suffix_lens)
  out = normalize_partials(merge_partials(prefix, suffix))
  return out.reshape(s, hq, d).astype(q.dtype)
