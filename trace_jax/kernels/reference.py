"""Tree decode attention in pure jnp: the CPU path and the oracle the Pallas kernels are tested on.

`tree_attention_reference` follows the contract in `partials` (layout there): the prefix phase
runs all branch queries of a group as the rows of one einsum against the group's gathered pages,
the suffix phase one slot at a time, and the two merge by log-sum-exp. `paged_attention_reference`
is plain per-slot paged attention (no sharing), and `dense_attention_oracle` an ordinary softmax
over explicit sequences (no paging, no partials) for tests.

`paged_partials_reference` is the shared "rows against a paged sequence" core in jnp; the GPU
(`gpu._paged_partials_pallas`) and TPU (`tpu.paged_partials_tpu`) kernels implement the same
contract. Imports only `partials`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from trace_jax.kernels.partials import (MASK_VALUE, Partials, check_tree_args, group_rows,
                                        merge_partials, normalize_partials,
                                        prefix_partials_per_slot, resolve_scale, slot_rows)


def paged_partials_reference(rows, k_pages, v_pages, tables, lens, sm_scale) -> Partials:
  """Rows against a paged sequence: rows [N, Hkv, M, D], tables i32[N, P], lens i32[N].

  Every row of n attends to the first lens[n] tokens of pages tables[n] (pools [num_pages,
  page_size, Hkv, D]). Returns f32 partials o [N, Hkv, M, D], m and l [N, Hkv, M]. The gather
  reads each table's pages once for all M rows.
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
  scale = resolve_scale(d, sm_scale)
  p = paged_partials_reference(
      slot_rows(q, k_pages.shape[2]), k_pages, v_pages, page_table, lens, scale
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
    [S, Hq, D] in q.dtype (layout details in `trace_jax.kernels.partials`).

  Example:
    >>> from trace_jax.kernels import paged_attention_reference
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
  check_tree_args(q, k_pages, v_pages, group_pages, group_lens, group_slots, suffix_pages,
                  suffix_lens)
  s, hq, d = q.shape
  hkv = k_pages.shape[2]
  scale = resolve_scale(d, sm_scale)
  prefix = paged_partials_reference(
      group_rows(q, group_slots, hkv), k_pages, v_pages, group_pages, group_lens, scale
  )
  prefix = prefix_partials_per_slot(prefix, group_slots, s)
  suffix = paged_partials_reference(
      slot_rows(q, hkv), k_pages, v_pages, suffix_pages, suffix_lens, scale
  )
  out = normalize_partials(merge_partials(prefix, suffix))
  return out.reshape(s, hq, d).astype(q.dtype)


def dense_attention_oracle(q, k_seq, v_seq, lens, *, sm_scale=None):
  """Test oracle over explicit sequences: q [S, Hq, D], k_seq/v_seq [S, T, Hkv, D], lens i32[S].

  Uses an ordinary softmax in f32 (no paging, no partials). Returns [S, Hq, D] in q.dtype; slots
  with lens == 0 give zeros.
  """
  s, hq, d = q.shape
  hkv = k_seq.shape[2]
  scale = resolve_scale(d, sm_scale)
  rows = slot_rows(q, hkv).astype(jnp.float32)
  logits = jnp.einsum("shgd,sthd->shgt", rows, k_seq.astype(jnp.float32)) * scale
  valid = (jnp.arange(k_seq.shape[1])[None, :] < lens[:, None])[:, None, None, :]
  w = jax.nn.softmax(jnp.where(valid, logits, -jnp.inf), axis=-1)
  w = jnp.where(valid, w, 0.0)  # rows with no keys: softmax of all -inf is NaN
  out = jnp.einsum("shgt,sthd->shgd", w, v_seq.astype(jnp.float32))
  return out.reshape(s, hq, d).astype(q.dtype)
