"""Block-sparse attention for packed rows (tree packing's `kv_end`, segments): the key blocks no
query of a query block can see are skipped, not masked, so a row costs its visible blocks instead
of its length squared.

Two halves:
- `kv_block_lists` (numpy, on the host, where the batch is packed) lists per query block the key
  blocks that any of its queries may see, padded to one width M per batch with a count.
- `blocked_attention` (jnp, inside jit) gathers those key blocks, applies the exact token mask of
  the dense path (`decoder.forward`'s: causal, real keys, same segment, key's `kv_end`, and every
  token sees itself) on the gathered tiles only, and takes an online softmax in f32 over chunks of
  block slots. Gradients are jax's own through the gather (a scatter-add onto the key blocks).

The score tiles are [B, T/blk, H, blk, M * blk]: memory and work scale with the listed blocks,
never with [T, T]. A listed block that holds no visible key for some query is masked per token, so
the block lists may be a superset (padding slots beyond the count are masked off), and the result
equals `attention.dense_attention` with the dense mask up to f32 summation order
(tests/test_blocked_attention.py).

Block size: 64 by default. The tiles' matmuls are [blk, D] x [D, M * blk]; 64 keeps tree rows'
blocks narrow enough that a node's own block rarely drags in unrelated siblings, while the
per-tile matmuls stay large enough for the CPU's vector units (32 measured slower on the tiny
model, 128 skips fewer blocks on deep trees).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

DEFAULT_BLOCK = 64
_NEG = -1e30  # as `attention.dense_attention`: finite, so a masked slot never gives NaN


def block_size_for(row_len: int, num_q_blocks: int) -> int:
  """The block size both halves derive from a row length and a block count, so the jitted side
  reads it from the block lists' shape: ceil(row_len / num_q_blocks)."""
  return -(-int(row_len) // int(num_q_blocks))


def kv_block_lists(kv_end=None, segment_ids=None, attn_mask=None, *, row_len: int | None = None,
                   block: int = DEFAULT_BLOCK, max_blocks: int | None = None):
  """Per query block, the key blocks any of its queries may see (numpy, host side).

  kv_end, segment_ids: i32[B, T] or None (as `decoder.forward` takes them); attn_mask: bool[B, T]
  (default: segment_ids > 0, else all real). Key j is seen at most by queries j .. hi_j - 1, where
  hi_j is kv_end[j], capped at the last index of j's segment + 1 (j + 1 for a pad key: only
  itself). A key block kb is listed for query block qb >= kb when some key of kb reaches qb's first
  query; the diagonal block always is.

  Returns (blocks i32[B, nQ, M], counts i32[B, nQ]) with nQ = ceil(T / block) and the block size
  `block_size_for(T, nQ)`: the first counts[b, q] entries are the listed key blocks (ascending), the
  rest padding. M is `max_blocks` when given (an error if some query block needs more), else the
  largest count rounded up to `list_width`'s steps (at most nQ), so batches compile a few shapes.
  """
  arrays = [a for a in (kv_end, segment_ids, attn_mask) if a is not None]
  if arrays:
    b, t = np.shape(arrays[0])
  elif row_len is None:
    raise ValueError("kv_block_lists needs kv_end, segment_ids, attn_mask or row_len")
  else:
    b, t = 1, int(row_len)
  nq = -(-t // min(block, t))
  blk = block_size_for(t, nq)
  idx = np.arange(t)
  hi = np.full((b, t), t, np.int64) if kv_end is None else np.asarray(kv_end, np.int64).copy()
  if segment_ids is not None:
    seg = np.asarray(segment_ids, np.int64)
    last = np.full((b, int(seg.max(initial=0)) + 1), -1, np.int64)
    np.maximum.at(last, (np.repeat(np.arange(b), t), seg.reshape(-1)), np.tile(idx, b))
    hi = np.minimum(hi, np.take_along_axis(last, seg, axis=1) + 1)
    if attn_mask is None:
      attn_mask = seg > 0
  if attn_mask is not None:
    hi = np.where(np.asarray(attn_mask, bool), hi, idx + 1)
  hi = np.maximum(hi, idx + 1)  # every token sees itself
  pad = nq * blk - t
  hi = np.pad(hi, ((0, 0), (0, pad)), constant_values=0)
  reach = hi.reshape(b, nq, blk).max(-1)  # [B, nK]: the furthest query a key block reaches
  qb, kb = np.arange(nq)[:, None], np.arange(nq)[None, :]
  vis = (qb == kb)[None] | ((kb < qb)[None] & (reach[:, None, :] > (qb * blk)[None]))
  counts = vis.sum(-1).astype(np.int32)
  need = int(counts.max(initial=1))
  if max_blocks is None:
    width = min(list_width(need), nq)
  elif max_blocks < need:
    raise ValueError(f"a query block sees {need} key blocks, more than max_blocks={max_blocks}")
  else:
    width = min(int(max_blocks), nq)
  order = np.argsort(~vis, axis=-1, kind="stable")[..., :width]  # listed blocks first, ascending
  return order.astype(np.int32), counts


def list_width(need: int) -> int:
  """`need` rounded up to four steps per doubling (1..4, 5, 6, 7, 8, 10, 12, 14, 16, 20, ...):
  every padded slot costs a whole score tile, so a power of two would waste up to half the work
  (measured 2x on a CPU's backward), while a width per count would compile a shape per batch."""
  step = 1 << max(int(need).bit_length() - 3, 0)
  return -(-int(need) // step) * step


def visible_block_fraction(counts, num_q_blocks: int | None = None) -> float:
  """Listed (query block, key block) pairs over the dense causal pairs nQ (nQ + 1) / 2 per row."""
  counts = np.asarray(counts)
  nq = num_q_blocks or counts.shape[-1]
  return float(counts.sum()) / (counts.shape[0] * nq * (nq + 1) / 2)


def _gather_blocks(x, blocks):
  """x: [B, nK, blk, ...], blocks: i32[B, nQ, M] -> [B, nQ, M, blk, ...]."""
  b, nk = x.shape[:2]
  flat = x.reshape((b * nk,) + x.shape[2:])
  rows = blocks + (jnp.arange(b, dtype=blocks.dtype) * nk)[:, None, None]
  return jnp.take(flat, rows, axis=0)


def blocked_attention(q, k, v, blocks, counts, kv_end=None, segment_ids=None, attn_mask=None,
                      chunk: int | None = None):
  """Attention over the key blocks of `kv_block_lists`, equal to the dense masked attention.

  q: [B, T, H, D]; k, v: [B, T, Hkv, D] (the same rows: self-attention of a packed row);
  blocks: i32[B, nQ, M], counts: i32[B, nQ] from `kv_block_lists` on the same kv_end,
  segment_ids and attn_mask (i32/bool[B, T] or None; attn_mask defaults to segment_ids > 0).
  chunk: block slots per online-softmax step (None: all M in one step; smaller bounds the live
  score tile at [B, nQ, H, blk, chunk * blk]). Returns [B, T, H, D] in q's dtype.
  """
  b, t, h, d = q.shape
  hkv = k.shape[2]
  g = h // hkv
  nq, m = blocks.shape[1], blocks.shape[2]
  blk = block_size_for(t, nq)
  tp = nq * blk
  idx = jnp.arange(tp, dtype=jnp.int32)
  if attn_mask is None:
    attn_mask = (segment_ids > 0) if segment_ids is not None else jnp.ones((b, t), bool)
  seg = segment_ids if segment_ids is not None else jnp.zeros((b, t), jnp.int32)
  end = kv_end if kv_end is not None else jnp.full((b, t), tp, jnp.int32)
  pad = tp - t
  if pad:  # pad rows to whole blocks: pad keys are seen by nobody, pad queries see themselves
    q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
    attn_mask = jnp.pad(attn_mask.astype(bool), ((0, 0), (0, pad)))
    seg = jnp.pad(seg, ((0, 0), (0, pad)))
    end = jnp.pad(end, ((0, 0), (0, pad)))
  attn_mask = attn_mask.astype(bool)
  # Queries [B, nQ, Hkv, g * blk, D] (the GQA group folded into the rows, as the dense path does).
  qg = q.reshape(b, nq, blk, hkv, g, d).transpose(0, 1, 3, 4, 2, 5).reshape(b, nq, hkv, g * blk, d)
  kb = k.reshape(b, nq, blk, hkv, d)
  vb = v.reshape(b, nq, blk, hkv, d)
  meta = jnp.stack([idx[None].repeat(b, 0), seg.astype(jnp.int32), end.astype(jnp.int32),
                    attn_mask.astype(jnp.int32)], -1).reshape(b, nq, blk, 4)
  q_idx = idx.reshape(nq, blk)[None, :, :, None]  # [1, nQ, blk, 1]
  q_seg = seg.reshape(b, nq, blk)[..., None]
  scale = d ** -0.5
  step = m if chunk is None else max(1, min(int(chunk), m))
  run_max = jnp.full((b, nq, hkv, g * blk, 1), _NEG, jnp.float32)
  run_sum = jnp.zeros((b, nq, hkv, g * blk, 1), jnp.float32)
  acc = jnp.zeros((b, nq, hkv, g * blk, d), jnp.float32)
  for s0 in range(0, m, step):
    sl = blocks[:, :, s0:s0 + step]
    w = sl.shape[-1]
    kt = _gather_blocks(kb, sl).transpose(0, 1, 4, 2, 3, 5).reshape(b, nq, hkv, w * blk, d)
    vt = _gather_blocks(vb, sl).transpose(0, 1, 4, 2, 3, 5).reshape(b, nq, hkv, w * blk, d)
    km = _gather_blocks(meta, sl).reshape(b, nq, 1, w * blk, 4)  # [B, nQ, 1, S, 4]
    k_idx, k_seg, k_end, k_ok = (km[..., i] for i in range(4))
    slot_ok = (s0 + jnp.arange(w))[None, None, :] < counts[:, :, None]  # [B, nQ, w]
    slot_ok = jnp.repeat(slot_ok, blk, axis=-1)[:, :, None, :]  # [B, nQ, 1, S]
    seen = ((k_idx <= q_idx) & (k_ok > 0) & (k_seg == q_seg) & (q_idx < k_end)) | (k_idx == q_idx)
    mask = (seen & slot_ok)[:, :, None, None]  # [B, nQ, 1, 1, blk, S] over (Hkv, g)
    s = jnp.einsum("bqkmd,bqksd->bqkms", qg, kt, preferred_element_type=jnp.float32) * scale
    s = s.reshape(b, nq, hkv, g, blk, w * blk)
    s = jnp.where(mask, s, _NEG).reshape(b, nq, hkv, g * blk, w * blk)
    new_max = jnp.maximum(run_max, s.max(-1, keepdims=True))
    p = jnp.exp(s - new_max)
    corr = jnp.exp(run_max - new_max)
    run_sum = run_sum * corr + p.sum(-1, keepdims=True)
    acc = acc * corr + jnp.einsum("bqkms,bqksd->bqkmd", p.astype(v.dtype), vt,
                                  preferred_element_type=jnp.float32)
    run_max = new_max
  o = acc / run_sum  # every query sees itself through a listed diagonal block: run_sum >= 1
  o = o.reshape(b, nq, hkv, g, blk, d).transpose(0, 1, 4, 2, 3, 5).reshape(b, tp, h, d)
  return o[:, :t].astype(q.dtype)


def dense_tree_mask(t: int, kv_end=None, segment_ids=None, attn_mask=None):
  """bool[B, T, T]: the cache-free mask of `decoder.forward` (the reference the blocked path
  equals): causal, real keys, same segment, each key's kv_end, and every token sees itself."""
  b = next((a.shape[0] for a in (kv_end, segment_ids, attn_mask) if a is not None), 1)
  if attn_mask is None:
    attn_mask = (segment_ids > 0) if segment_ids is not None else jnp.ones((b, t), bool)
  i = jnp.arange(t)
  mask = (i[:, None] >= i[None, :])[None] & attn_mask.astype(bool)[:, None, :]
  if segment_ids is not None:
    mask &= segment_ids[:, :, None] == segment_ids[:, None, :]
  if kv_end is not None:
    mask &= i[None, :, None] < kv_end[:, None, :]
  return mask | jnp.eye(t, dtype=bool)[None]


__all__ = ["DEFAULT_BLOCK", "block_size_for", "blocked_attention", "dense_tree_mask",
           "kv_block_lists", "list_width", "visible_block_fraction"]
