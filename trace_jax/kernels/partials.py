"""Tree-attention pieces every backend shares: the layout, partial softmax state, argument checks.

Sibling branches of a rollout tree share the KV pages of their common prefix. A decode step attends
each slot's single query to (its group's shared prefix tokens, then its own suffix tokens). The
work splits in two phases whose partial softmax results merge by log-sum-exp:

- prefix phase: for each group, the queries of all its branches (times the q heads that share one kv
  head) are stacked as the rows of one matmul against the group's pages, so the shared prefix KV
  is read once per group rather than once per branch;
- suffix phase: plain paged decode attention, one slot at a time.

Layout (one layer), the contract of every implementation:
  q:            [S, Hq, D]             one decode query per slot; Hq = G * Hkv, q head h uses kv
                                       head h // G.
  k_pages:      [num_pages, page_size, Hkv, D]   (v_pages alike)
  group_pages:  i32[NG, Pg]            page ids of each group's prefix (padding ids in range)
  group_lens:   i32[NG]                valid prefix tokens per group (0 allowed)
  group_slots:  i32[NG, B]             slots of each group, -1 padded; a slot is in at most one
                                       group, a slot in no group has no prefix
  suffix_pages: i32[S, Ps], suffix_lens: i32[S]  (0 allowed)
  output:       [S, Hq, D], zeros for a slot with no tokens at all.

Every backend (`reference`, `gpu`, `tpu`) implements one core, "rows against a paged sequence"
([N, Hkv, M, D] rows, i32[N, P] tables, i32[N] lengths -> `Partials`), and runs it twice with the
row layouts built here (`group_rows`, `slot_rows`), then merges with `merge_partials`. This module
imports no other kernel module, so any of them may build on it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

# A finite "minus infinity": exp(MASK_VALUE - MASK_VALUE) stays finite, so a row without tokens
# yields l = 0 and o = 0 instead of NaN, and merging two empty partials stays empty.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


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


def check_tree_args(q, k_pages, v_pages, group_pages, group_lens, group_slots, suffix_pages,
                    suffix_lens):
  """Raises ValueError on inconsistent static shapes (cheap: runs at trace time only).

  Shapes as in the module docstring: q [S, Hq, D], pools [num_pages, page_size, Hkv, D],
  group_pages [NG, Pg], group_lens [NG], group_slots [NG, B], suffix_pages [S, Ps], suffix_lens [S].
  """
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


def resolve_scale(head_dim: int, sm_scale: float | None) -> float:
  """The logit scale: `sm_scale` if given, else head_dim**-0.5."""
  return head_dim**-0.5 if sm_scale is None else float(sm_scale)


# ---------------------------------------------------------------------------------------------
# Row layouts: every backend runs the same "rows against a paged sequence" core on these.
# ---------------------------------------------------------------------------------------------


def slot_rows(q: jax.Array, num_kv_heads: int) -> jax.Array:
  """[S, Hq, D] -> [S, Hkv, G, D]: the G query heads that read one kv head become matmul rows."""
  s, hq, d = q.shape
  return q.reshape(s, num_kv_heads, hq // num_kv_heads, d)


def group_rows(q: jax.Array, group_slots: jax.Array, num_kv_heads: int) -> jax.Array:
  """Stacks the queries of all branches of each group: -> [NG, Hkv, B*G, D], row = b*G + g.

  Padding branches (-1) gather slot 0; their rows are computed and then dropped.
  """
  s, hq, d = q.shape
  ng, b = group_slots.shape
  g = hq // num_kv_heads
  qg = q[jnp.clip(group_slots, 0, s - 1)]  # [NG, B, Hq, D]
  qg = qg.reshape(ng, b, num_kv_heads, g, d).transpose(0, 2, 1, 3, 4)
  return qg.reshape(ng, num_kv_heads, b * g, d)


def prefix_partials_per_slot(p: Partials, group_slots: jax.Array, num_slots: int) -> Partials:
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

