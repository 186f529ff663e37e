"""Tree (cascade) decode attention over a paged KV pool.

Sibling branches of a rollout tree share the KV pages of their common prefix. A decode step attends
each slot's single query to (its group's shared prefix tokens, then its own suffix tokens). The
work splits in two phases whose partial softmax results merge by log-sum-exp:

- prefix phase: for each group, the queries of all its branches (times the q heads that share one kv
  head) are stacked as the rows of one matmul against the group's pages, so the shared prefix KV
  is read once per group rather than once per branch;
- suffix phase: plain paged decode attention, one slot at a time.

Layout (one layer):
  q:            [S, Hq, D]             one decode query per slot; Hq = G * Hkv, q head h uses kv
                                       head h // G.
  k_pages:      [num_pages, page_size, Hkv, D]   (v_pages alike)
  group_pages:  i32[NG, Pg]            page ids of each group's prefix (padding ids in range)
  group_lens:   i32[NG]                valid prefix tokens per group (0 allowed)
  group_slots:  i32[NG, B]             slots of each group, -1 padded; a slot is in at most one
                                       group, a slot in no group has no prefix
  suffix_pages: i32[S, Ps], suffix_lens: i32[S]  (0 allowed)
  output:       [S, Hq, D], zeros for a slot with no tokens at all.

Three implementations live here: `tree_attention_reference` (pure jnp, the CPU path and the test
oracle's sibling), `tree_attention_pallas` (a Triton-style Pallas kernel for GPU, also runnable in
interpret mode) and the `tree_attention` dispatcher. The TPU (Mosaic) kernel is
`tree_attention_tpu.tree_attention_tpu`; `tree_attention_sharded` runs any of them under
`shard_map` on a mesh.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # Present in GPU-capable jax builds; only needed to pick the Triton lowering on GPU.
  from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover
  pltriton = None

# A finite "minus infinity": exp(MASK_VALUE - MASK_VALUE) stays finite, so a row without tokens
# yields l = 0 and o = 0 instead of NaN, and merging two empty partials stays empty.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
IMPL_ENV_VAR = "TRACE_JAX_ATTENTION_IMPL"
IMPLS = ("auto", "reference", "pallas", "pallas_interpret", "pallas_tpu", "pallas_tpu_interpret")


class Partials(NamedTuple):
  """Unnormalized softmax-attention state over a subset of the keys.

  o: f32[..., D] sum_t exp(s_t - m) v_t;  m: f32[...] max logit (MASK_VALUE if no keys);
  l: f32[...] sum_t exp(s_t - m) (0 if no keys). The attention output is o / l.
  """

  o: jax.Array
  m: jax.Array
  l: jax.Array


def merge_partials(a: Partials, b: Partials) -> Partials:
  """Log-sum-exp merge of two partials over disjoint key sets (same leading shapes)."""
  m = jnp.maximum(a.m, b.m)
  ca = jnp.exp(a.m - m)
  cb = jnp.exp(b.m - m)
  return Partials(o=a.o * ca[..., None] + b.o * cb[..., None], m=m, l=a.l * ca + b.l * cb)


def merge_split_partials(p: Partials) -> Partials:
  """Log-sum-exp merge over the leading axis (key splits): [C, ...] -> [...]."""
  m = p.m.max(axis=0)
  c = jnp.exp(p.m - m)
  return Partials(o=(p.o * c[..., None]).sum(axis=0), m=m, l=(p.l * c).sum(axis=0))


def normalize_partials(p: Partials) -> jax.Array:
  """o / l with rows that saw no keys mapped to zeros (not NaN)."""
  return p.o / jnp.where(p.l > 0, p.l, 1.0)[..., None]


def _check_tree_args(q, k_pages, v_pages, group_pages, group_lens, group_slots, suffix_pages,
                     suffix_lens):
  """Raises ValueError on inconsistent static shapes (cheap: runs at trace time only)."""
  s, hq, d = q.shape
  if k_pages.shape != v_pages.shape or k_pages.ndim != 4 or k_pages.shape[3] != d:
    raise ValueError(f"k/v pages must be [num_pages, page_size, Hkv, {d}]: {k_pages.shape}, "
                     f"{v_pages.shape}")
  if hq % k_pages.shape[2]:
    raise ValueError(f"num_q_heads {hq} is not a multiple of num_kv_heads {k_pages.shape[2]}")
  ng = group_pages.shape[0]
  if group_lens.shape != (ng,) or group_slots.ndim != 2 or group_slots.shape[0] != ng:
    raise ValueError(f"group shapes disagree: pages {group_pages.shape}, lens {group_lens.shape},"
                     f" slots {group_slots.shape}")
  if suffix_pages.ndim != 2 or suffix_pages.shape[0] != s or suffix_lens.shape != (s,):
    raise ValueError(f"suffix shapes must be [{s}, Ps] and [{s}]: {suffix_pages.shape}, "
                     f"{suffix_lens.shape}")


def _resolve_scale(head_dim: int, sm_scale: float | None) -> float:
  return head_dim**-0.5 if sm_scale is None else float(sm_scale)


# ---------------------------------------------------------------------------------------------
# Shared layout helpers: both implementations run the same "rows against a paged sequence" core.
# ---------------------------------------------------------------------------------------------


def _slot_rows(q: jax.Array, num_kv_heads: int) -> jax.Array:
  """[S, Hq, D] -> [S, Hkv, G, D]: the G query heads that read one kv head become matmul rows."""
  s, hq, d = q.shape
  return q.reshape(s, num_kv_heads, hq // num_kv_heads, d)


def _group_rows(q: jax.Array, group_slots: jax.Array, num_kv_heads: int) -> jax.Array:
  """Stacks the queries of all branches of each group: -> [NG, Hkv, B*G, D], row = b*G + g.

  Padding branches (-1) gather slot 0; their rows are computed and then dropped.
  """
  s, hq, d = q.shape
  ng, b = group_slots.shape
  g = hq // num_kv_heads
  qg = q[jnp.clip(group_slots, 0, s - 1)]  # [NG, B, Hq, D]
  qg = qg.reshape(ng, b, num_kv_heads, g, d).transpose(0, 2, 1, 3, 4)
  return qg.reshape(ng, num_kv_heads, b * g, d)


def _prefix_partials_per_slot(p: Partials, group_slots: jax.Array, num_slots: int) -> Partials:
  """Scatters prefix partials [NG, Hkv, B*G(, D)] back to slots: -> [S, Hkv, G(, D)].

  A slot in no group gets the empty partial (o = 0, m = MASK_VALUE, l = 0).
  """
  ng, hkv, bg = p.m.shape
  b = group_slots.shape[1]
  g = bg // b
  flat = group_slots.reshape(-1)
  target = jnp.where(flat >= 0, flat, num_slots)  # -1 padding -> out of range -> dropped
  group_of_entry = jnp.repeat(jnp.arange(ng, dtype=jnp.int32), b)
  branch_of_entry = jnp.tile(jnp.arange(b, dtype=jnp.int32), ng)
  slot_group = jnp.full((num_slots,), -1, jnp.int32).at[target].set(group_of_entry, mode="drop")
  slot_branch = jnp.zeros((num_slots,), jnp.int32).at[target].set(branch_of_entry, mode="drop")
  has_prefix = slot_group >= 0
  gi = jnp.maximum(slot_group, 0)

  def pick(x):  # [NG, Hkv, B*G, ...] -> [S, Hkv, G, ...]
    x = x.reshape(ng, hkv, b, g, *x.shape[3:])
    x = jnp.moveaxis(x, 2, 1)[gi, slot_branch]
    return x

  mask = has_prefix[:, None, None]
  return Partials(
      o=jnp.where(mask[..., None], pick(p.o), 0.0),
      m=jnp.where(mask, pick(p.m), MASK_VALUE),
      l=jnp.where(mask, pick(p.l), 0.0),
  )


# ---------------------------------------------------------------------------------------------
# Reference (pure jnp): the CPU path.
# ---------------------------------------------------------------------------------------------


def _paged_partials_reference(rows, k_pages, v_pages, tables, lens, sm_scale) -> Partials:
  """Rows against a paged sequence: rows [N, Hkv, M, D], tables i32[N, P], lens i32[N].

  Every row of n attends to the first lens[n] tokens of pages tables[n]. Returns f32 partials
  o [N, Hkv, M, D], m and l [N, Hkv, M]. The gather reads each table's pages once for all M rows.
  """
  n, p = tables.shape
  _, page_size, hkv, d = k_pages.shape
  t = p * page_size
  k = k_pages[tables].reshape(n, t, hkv, d)
  v = v_pages[tables].reshape(n, t, hkv, d)
  logits = jnp.einsum("nhmd,nthd->nhmt", rows, k, preferred_element_type=jnp.float32)
  logits = logits * sm_scale
  valid = (jnp.arange(t)[None, :] < lens[:, None])[:, None, None, :]
  logits = jnp.where(valid, logits, MASK_VALUE)
  m = logits.max(axis=-1)
  e = jnp.where(valid, jnp.exp(logits - m[..., None]), 0.0)
  o = jnp.einsum("nhmt,nthd->nhmd", e, v.astype(jnp.float32))
  return Partials(o=o, m=m, l=e.sum(axis=-1))


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def paged_attention_reference(q, k_pages, v_pages, page_table, lens, *, sm_scale=None):
  """Plain per-slot paged decode attention (no sharing), pure jnp.

  Args:
    q: [S, Hq, D]; k_pages, v_pages: [num_pages, page_size, Hkv, D].
    page_table: i32[S, P] page ids per slot; lens: i32[S] valid tokens per slot (0 allowed).
    sm_scale: logit scale, default D**-0.5.

  Returns:
    [S, Hq, D] in q.dtype; zeros for slots with lens == 0.
  """
  s, hq, d = q.shape
  scale = _resolve_scale(d, sm_scale)
  p = _paged_partials_reference(
      _slot_rows(q, k_pages.shape[2]), k_pages, v_pages, page_table, lens, scale
  )
  return normalize_partials(p).reshape(s, hq, d).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def tree_attention_reference(
    q, k_pages, v_pages, group_pages, group_lens, group_slots, suffix_pages, suffix_lens,
    *, sm_scale=None,
):
  """Tree decode attention in pure jnp: the CPU path and the oracle the kernels are tested against.

  Args:
    q: [S, Hq, D] one decode query per slot.
    k_pages, v_pages: [num_pages, page_size, Hkv, D] the paged KV pool of one layer.
    group_pages: i32[NG, Pg] page ids of each group's shared prefix; group_lens: i32[NG] its tokens.
    group_slots: i32[NG, B] slots of each group, -1 padded.
    suffix_pages: i32[S, Ps] page ids of each slot's own suffix; suffix_lens: i32[S] its tokens.
    sm_scale: logit scale, default D**-0.5.

  Returns:
    [S, Hq, D] in q.dtype (layout details in the module docstring).

  Example:
    >>> from trace_jax.kernels.tree_attention import paged_attention_reference
    >>> k, v = jax.random.normal(jax.random.key(0), (2, 8, 4, 1, 16))  # 8 pages of 4 tokens
    >>> q = jax.random.normal(jax.random.key(1), (2, 2, 16))  # 2 branches, 2 q heads, 1 kv head
    >>> out = tree_attention_reference(q, k, v, jnp.array([[1, 2]]), jnp.array([8]),
    ...                                jnp.array([[0, 1]]), jnp.array([[3], [4]]),
    ...                                jnp.array([2, 3]))
    >>> flat = paged_attention_reference(q, k, v, jnp.array([[1, 2, 3], [1, 2, 4]]),
    ...                                  jnp.array([10, 11]))  # the prefix in each slot's table
    >>> out.shape, bool(jnp.allclose(out, flat, atol=1e-5))
    ((2, 2, 16), True)
  """
  _check_tree_args(q, k_pages, v_pages, group_pages, group_lens, group_slots, suffix_pages,
                   suffix_lens)
  s, hq, d = q.shape
  hkv = k_pages.shape[2]
  scale = _resolve_scale(d, sm_scale)
  prefix = _paged_partials_reference(
      _group_rows(q, group_slots, hkv), k_pages, v_pages, group_pages, group_lens, scale
  )
  prefix = _prefix_partials_per_slot(prefix, group_slots, s)
  suffix = _paged_partials_reference(
      _slot_rows(q, hkv), k_pages, v_pages, suffix_pages, suffix_lens, scale
  )
  out = normalize_partials(merge_partials(prefix, suffix))
  return out.reshape(s, hq, d).astype(q.dtype)


def dense_attention_oracle(q, k_seq, v_seq, lens, *, sm_scale=None):
  """Test oracle over explicit sequences: q [S, Hq, D], k_seq/v_seq [S, T, Hkv, D], lens i32[S].

  Uses an ordinary softmax in f32 (no paging, no partials). Slots with lens == 0 give zeros.
  """
  s, hq, d = q.shape
  hkv = k_seq.shape[2]
  scale = _resolve_scale(d, sm_scale)
  rows = _slot_rows(q, hkv).astype(jnp.float32)
  logits = jnp.einsum("shgd,sthd->shgt", rows, k_seq.astype(jnp.float32)) * scale
  valid = (jnp.arange(k_seq.shape[1])[None, :] < lens[:, None])[:, None, None, :]
  w = jax.nn.softmax(jnp.where(valid, logits, -jnp.inf), axis=-1)
  w = jnp.where(valid, w, 0.0)  # rows with no keys: softmax of all -inf is NaN
  out = jnp.einsum("shgt,sthd->shgd", w, v_seq.astype(jnp.float32))
  return out.reshape(s, hq, d).astype(q.dtype)


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
# HBM are not supported there. The TPU version (tree_attention_tpu.py) passes the page tables and
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
  """Pallas version of `_paged_partials_reference` (same shapes and semantics)."""
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
  """Tree decode attention with Pallas kernels (layout in the module docstring).

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
  kernel for what the TPU version (tree_attention_tpu.py) does differently.

  Returns:
    [S, Hq, D] in q.dtype.
  """
  _check_tree_args(q, k_pages, v_pages, group_pages, group_lens, group_slots, suffix_pages,
                   suffix_lens)
  s, hq, d = q.shape
  hkv = k_pages.shape[2]
  scale = _resolve_scale(d, sm_scale)
  run = functools.partial(
      _paged_partials_pallas, sm_scale=scale, block_k=block_k, block_m=block_m,
      num_splits=num_splits, num_warps=num_warps, num_stages=num_stages, interpret=interpret,
  )
  prefix = run(_group_rows(q, group_slots, hkv), k_pages, v_pages, group_pages, group_lens)
  prefix = _prefix_partials_per_slot(prefix, group_slots, s)
  suffix = run(_slot_rows(q, hkv), k_pages, v_pages, suffix_pages, suffix_lens)
  out = normalize_partials(merge_partials(prefix, suffix))
  return out.reshape(s, hq, d).astype(q.dtype)


# ---------------------------------------------------------------------------------------------
# Dispatch.
# ---------------------------------------------------------------------------------------------


def resolve_impl(impl: str = "auto") -> str:
  """Picks the implementation: argument, else $TRACE_JAX_ATTENTION_IMPL, else by backend.

  "auto" means the Triton kernel ("pallas") on GPU, the Mosaic kernel ("pallas_tpu") on TPU and
  the reference elsewhere (CPU). "pallas" asked for explicitly on TPU means the Mosaic kernel.
  The "*_interpret" impls run a kernel with the Pallas interpreter (CPU tests).
  """
  if impl == "auto":
    impl = os.environ.get(IMPL_ENV_VAR, "auto") or "auto"
  if impl not in IMPLS:
    raise ValueError(f"unknown attention impl {impl!r}; expected one of {IMPLS}")
  backend = jax.default_backend()
  if impl == "auto":
    impl = {"gpu": "pallas", "tpu": "pallas_tpu"}.get(backend, "reference")
  if impl == "pallas" and backend == "tpu":
    impl = "pallas_tpu"
  return impl


def tree_attention(
    q, k_pages, v_pages, group_pages, group_lens, group_slots, suffix_pages, suffix_lens,
    *, sm_scale=None, impl="auto",
):
  """Tree decode attention; impl in IMPLS (see `resolve_impl`).

  Sibling branches (slots) of a group attend to the group's shared prefix pages, read once for all
  of them, then each to its own suffix pages; the two partial softmaxes merge by log-sum-exp.
  Arguments as `tree_attention_reference` (q [S, Hq, D], pools [num_pages, page_size, Hkv, D],
  group_pages i32[NG, Pg], group_lens i32[NG], group_slots i32[NG, B], suffix_pages i32[S, Ps],
  suffix_lens i32[S]); `impl` picks the implementation (`resolve_impl`: "auto" is the Pallas kernel
  on GPU, the reference elsewhere).

  Returns:
    [S, Hq, D] in q.dtype.

  Example:
    >>> k, v = jax.random.normal(jax.random.key(0), (2, 8, 4, 1, 16))  # 8 pages of 4 tokens
    >>> q = jax.random.normal(jax.random.key(1), (2, 2, 16))  # 2 branches, 2 q heads, 1 kv head
    >>> args = (q, k, v, jnp.array([[1, 2]]), jnp.array([8]), jnp.array([[0, 1]]),
    ...         jnp.array([[3], [4]]), jnp.array([2, 3]))  # prefix: pages 1-2, suffixes: 3 and 4
    >>> out = tree_attention(*args, impl="pallas_interpret")  # the GPU kernel, interpreted
    >>> bool(jnp.allclose(out, tree_attention_reference(*args), atol=1e-5))
    True
  """
  impl = resolve_impl(impl)
  args = (q, k_pages, v_pages, group_pages, group_lens, group_slots, suffix_pages, suffix_lens)
  if impl == "reference":
    return tree_attention_reference(*args, sm_scale=sm_scale)
  if impl in ("pallas_tpu", "pallas_tpu_interpret"):
    # Imported here: the TPU module builds on this one.
    from trace_jax.kernels.tree_attention_tpu import interpret_params, tree_attention_tpu

    interpret = interpret_params() if impl == "pallas_tpu_interpret" else False
    return tree_attention_tpu(*args, sm_scale=sm_scale, interpret=interpret)
  return tree_attention_pallas(*args, sm_scale=sm_scale, interpret=impl == "pallas_interpret")


__all__ = [
    "IMPL_ENV_VAR",
    "MASK_VALUE",
    "Partials",
    "dense_attention_oracle",
    "merge_partials",
    "merge_split_partials",
    "normalize_partials",
    "paged_attention_reference",
    "resolve_impl",
    "tree_attention",
    "tree_attention_pallas",
    "tree_attention_reference",
]
