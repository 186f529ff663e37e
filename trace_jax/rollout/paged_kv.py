"""Paged KV pool: a host-side reference-counted page allocator and the device page arrays.

The device pool holds, per layer, `k, v: [num_pages, page_size, Hkv, hd]`. Sequences own ordered
lists of page ids (their page tables). Forked branches share the full pages of their anchor (one
reference each) and write only into pages they own, so a page is immutable once shared.

Page 0 is reserved as a scratch ("null") page: padded prefill tokens and inactive decode slots write
there, and padded page-table entries point there, so no masked write can land in a live page.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

NULL_PAGE = 0


class PoolExhaustedError(RuntimeError):
  """The KV page pool has fewer free pages than a request needs."""


class PageAllocator:
  """Reference-counted page ids on the host.

  `alloc(n)` hands out n pages with count 1; `incref`/`decref` adjust counts and a page returns to
  the free list when its count reaches 0. Page 0 (the null page) is never handed out.
  """

  def __init__(self, num_pages: int):
    if num_pages < 2:
      raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
    self.num_pages = num_pages
    self.refcount = np.zeros(num_pages, np.int32)
    # Pop from the end: low page ids first keeps small runs compact, which is nice when debugging.
    self._free = list(range(num_pages - 1, 0, -1))

  @property
  def num_free(self) -> int:
    return len(self._free)

  @property
  def capacity(self) -> int:
    return self.num_pages - 1

  def alloc(self, n: int) -> list[int]:
    if n < 0:
      raise ValueError(f"alloc({n})")
    if n > len(self._free):
      raise PoolExhaustedError(
          f"KV pool exhausted: need {n} pages, {len(self._free)} of {self.capacity} free; raise "
          f"SamplerConfig.num_pages, lower num_slots/max_seq_len, or release finished trees")
    pages = [self._free.pop() for _ in range(n)]
    self.refcount[pages] = 1
    return pages

  def incref(self, pages) -> None:
    for p in pages:
      if self.refcount[p] <= 0:
        raise ValueError(f"incref of free page {p}")
      self.refcount[p] += 1

  def decref(self, pages) -> None:
    for p in pages:
      if self.refcount[p] <= 0:
        raise ValueError(f"decref of free page {p} (double free)")
      self.refcount[p] -= 1
      if self.refcount[p] == 0:
        self._free.append(p)


def init_pool(num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
              dtype=jnp.float32) -> dict:
  """Device pool {"k": [L x [P, ps, Hkv, hd]], "v": same}, zero-filled."""
  shape = (num_pages, page_size, num_kv_heads, head_dim)
  return {"k": [jnp.zeros(shape, dtype) for _ in range(num_layers)],
          "v": [jnp.zeros(shape, dtype) for _ in range(num_layers)]}


def pool_bytes(pool: dict) -> int:
  return sum(int(a.size) * a.dtype.itemsize for a in pool["k"] + pool["v"])


@functools.partial(jax.jit, donate_argnums=(0,))
def copy_pages(pool: dict, src: jax.Array, dst: jax.Array) -> dict:
  """pool[dst[i]] = pool[src[i]] for every layer. src, dst: i32[n]; pad both with NULL_PAGE.

  Used at a fork to give each branch its own copy of the anchor's last, partial page. The pool is
  donated so the copy is in place.
  """
  return jax.tree.map(lambda a: a.at[dst].set(a[src]), pool)


def write_tokens(pages: jax.Array, k_new: jax.Array, page_idx: jax.Array,
                 offset: jax.Array) -> jax.Array:
  """Scatters new tokens into one layer's pages.

  pages: [P, ps, Hkv, hd]; k_new: [N, Hkv, hd]; page_idx, offset: i32[N] (padding -> NULL_PAGE).
  """
  return pages.at[page_idx, offset].set(k_new.astype(pages.dtype))


def gather_sequences(pages: jax.Array, table: jax.Array) -> jax.Array:
  """[P, ps, Hkv, hd] and i32[B, Pt] page tables -> contiguous [B, Pt * ps, Hkv, hd]."""
  b, pt = table.shape
  g = pages[table]
  return g.reshape(b, pt * pages.shape[1], *pages.shape[2:])


def paged_prefill_attention(q, k_pages, v_pages, table, start, num_new):
  """Causal attention of a chunk of new tokens over its sequence's pages (pure jnp reference).

  Args:
    q: [B, C, H, hd] queries of the chunk, token t at sequence position start[b] + t.
    k_pages, v_pages: [P, ps, Hkv, hd], already holding the chunk's K/V.
    table: i32[B, Pt] page table per row; start: i32[B] tokens before the chunk;
    num_new: i32[B] real tokens in the chunk (the rest is right padding).

  Returns:
    [B, C, H, hd]; padded query rows are finite garbage.
  """
  from trace_jax.models.qwen3.model import dense_attention
  k = gather_sequences(k_pages, table).astype(q.dtype)
  v = gather_sequences(v_pages, table).astype(q.dtype)
  c = q.shape[1]
  kidx = jnp.arange(k.shape[1])[None, None, :]
  qpos = start[:, None, None] + jnp.arange(c)[None, :, None]
  real = (jnp.arange(c)[None, :] < num_new[:, None])[:, :, None]
  mask = (kidx <= qpos) & real
  # A padded row would otherwise see no key; give it its own slot so the softmax stays finite.
  mask = mask | (~real & (kidx == 0))
  return dense_attention(q, k, v, mask)


__all__ = ["NULL_PAGE", "PageAllocator", "PoolExhaustedError", "copy_pages", "gather_sequences",
           "init_pool", "paged_prefill_attention", "pool_bytes", "write_tokens"]
