"""Paged KV pool: a host-side reference-counted page allocator and the device page arrays.

The device pool holds, per layer, `k, v: [num_pages, page_size, Hkv, hd]`. Sequences own ordered
lists of page ids (their page tables). Forked branches share the full pages of their anchor (one
reference each) and write only into pages they own, so a page is immutable once shared.

Page 0 is reserved as a scratch ("null") page: padded prefill tokens and inactive decode slots write
there, and padded page-table entries point there, so no masked write can land in a live page.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from trace_jax.models.attention import dense_attention

NULL_PAGE = 0


def tree_pages(branches: int, max_seq_len: int, page_size: int, num_pages: int,
               shards: int = 1) -> tuple[int, int]:
  """(pages one tree of `branches` rollouts of `max_seq_len` tokens may need, pages one pool shard
  holds): the worst case, no prefix shared, against a shard's page range less its null page. A
  tree's pages all live on one shard, so the tree fits only when the first is at most the second."""
  return int(branches) * -(-int(max_seq_len) // int(page_size)), int(num_pages) // int(shards) - 1


class PoolExhaustedError(RuntimeError):
  """The KV page pool has fewer free pages than a request needs."""


class PageAllocator:
  """Reference-counted page ids on the host.

  `alloc(n)` hands out n pages with count 1; `incref`/`decref` adjust counts and a page returns to
  the free list when its count reaches 0. Page 0 (the null page) is never handed out.

  With `shards` > 1 the ids split into `shards` contiguous ranges of `num_pages // shards` pages,
  one per data shard of a mesh, each with its own free list and its own null page (the first id
  of its range): `alloc(n, shard)` draws from that range only, so the pages of a tree stay on the
  device block that holds its slots.
  """

  def __init__(self, num_pages: int, shards: int = 1):
    if shards < 1 or num_pages % shards:
      raise ValueError(f"num_pages {num_pages} does not split into {shards} shards")
    if num_pages // shards < 2:
      raise ValueError(f"num_pages must be >= 2 per shard (the first is reserved), got "
                       f"{num_pages} for {shards} shards")
    self.num_pages, self.shards = num_pages, shards
    self.pages_per_shard = num_pages // shards
    self.refcount = np.zeros(num_pages, np.int32)
    self.in_use = 0  # pages handed out and not yet free
    self.peak = 0    # the most in use at once since the caller last set it (e.g. to in_use)
    # Pop from the end: low page ids first keeps small runs compact, which is nice when debugging.
    n = self.pages_per_shard
    self._free = [list(range((s + 1) * n - 1, s * n, -1)) for s in range(shards)]

  def null_page(self, shard: int = 0) -> int:
    return shard * self.pages_per_shard

  def shard_of(self, page: int) -> int:
    return int(page) // self.pages_per_shard

  @property
  def num_free(self) -> int:
    return sum(len(f) for f in self._free)

  def num_free_in(self, shard: int) -> int:
    return len(self._free[shard])

  @property
  def capacity(self) -> int:
    return self.num_pages - self.shards

  def alloc(self, n: int, shard: int = 0) -> list[int]:
    if n < 0:
      raise ValueError(f"alloc({n})")
    free = self._free[shard]
    if n > len(free):
      where = f" of shard {shard}" if self.shards > 1 else ""
      raise PoolExhaustedError(
          f"KV pool exhausted: need {n} pages, {len(free)} of "
          f"{self.pages_per_shard - 1}{where} free; raise SamplerConfig.num_pages, lower "
          f"num_slots/max_seq_len, or release finished trees")
    pages = [free.pop() for _ in range(n)]
    self.refcount[pages] = 1
    self.in_use += n
    self.peak = max(self.peak, self.in_use)
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
        self._free[p // self.pages_per_shard].append(p)
        self.in_use -= 1


@dataclasses.dataclass(frozen=True)
class PoolLayout:
  """Where the KV pool and the per-slot arrays live on a mesh.

  Pages (and slots, page-table rows, prefill rows) split over `data_axes` into one contiguous
  block per data shard; KV heads split over `head_axis` (None: the axis does not divide the KV
  heads, which stay replicated, as the sharding rules do). Page and slot ids stay global on the
  host; device code that touches the pool runs under `shard_map` and subtracts its shard's offset.
  """

  mesh: Mesh
  data_axes: tuple = ("data", "fsdp")
  head_axis: str | None = "tensor"

  @staticmethod
  def for_mesh(mesh: Mesh, num_kv_heads: int) -> "PoolLayout":
    """Rows over every mesh axis but `tensor`, KV heads over `tensor` when it divides them."""
    data = tuple(a for a in mesh.axis_names if a != "tensor")
    head = "tensor" if "tensor" in mesh.axis_names else None
    if head is not None and num_kv_heads % mesh.shape[head]:
      head = None
    return PoolLayout(mesh, data, head)

  @property
  def shards(self) -> int:
    n = 1
    for a in self.data_axes:
      n *= self.mesh.shape[a]
    return n

  @property
  def rows(self):
    return self.data_axes or None

  @property
  def pool_spec(self) -> P:
    return P(self.rows, None, self.head_axis, None)

  @property
  def pool_sharding(self) -> NamedSharding:
    return NamedSharding(self.mesh, self.pool_spec)

  @property
  def row_sharding(self) -> NamedSharding:
    """Leading axis over the data shards (slots, groups, prefill rows), the rest replicated."""
    return NamedSharding(self.mesh, P(self.rows))

  def shard_index(self):
    """This shard's index along the data axes (inside `shard_map`)."""
    return lax.axis_index(self.data_axes) if self.data_axes else 0


class _HostInputs:
  """A jitted function whose host (numpy) arguments are first put on the function's input
  shardings (see `jit_pool_fn`); everything else (lower, cache size) is the jitted function's."""

  def __init__(self, jitted, in_shardings):
    self.jitted, self.in_shardings = jitted, in_shardings

  def __call__(self, *args):
    return self.jitted(*[a if s is None else jax.device_put(a, s)
                         for a, s in zip(args, self.in_shardings)])

  def __getattr__(self, name):
    return getattr(self.jitted, name)


def jit_pool_fn(fn, in_shardings, **kw):
  """`jax.jit(fn, in_shardings=...)` for the sampler's steps on a (process-local) mesh. In a
  multi-process run jit refuses host arguments with non-trivial shardings, even on this process's
  own devices; there the arguments are put on their shardings first. One process: plain jit."""
  jitted = jax.jit(fn, in_shardings=in_shardings, **kw)
  return jitted if jax.process_count() == 1 else _HostInputs(jitted, in_shardings)


def init_pool(num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
              dtype=jnp.float32, layout: PoolLayout | None = None) -> dict:
  """Device pool {"k": [L x [P, ps, Hkv, hd]], "v": same}, zero-filled; laid out by `layout`
  (pages over its data shards, KV heads over its head axis) when given."""
  shape = (num_pages, page_size, num_kv_heads, head_dim)
  if layout is None:
    make = lambda: jnp.zeros(shape, dtype)  # noqa: E731
  else:
    make = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=layout.pool_sharding)
  return {"k": [make() for _ in range(num_layers)], "v": [make() for _ in range(num_layers)]}


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


@functools.lru_cache(maxsize=16)
def make_copy_pages(layout: PoolLayout | None):
  """`copy_pages` for a pool laid out by `layout` (None: the single-device `copy_pages`).

  src, dst: i32[shards * n], global page ids, block s holding shard s's copies (pad with that
  shard's null page). Each shard copies within its own page range, nothing crosses devices.
  """
  if layout is None:
    return copy_pages
  def local(pool, src, dst):
    n = jax.tree.leaves(pool)[0].shape[0]
    off = layout.shard_index() * n
    return jax.tree.map(lambda a: a.at[dst - off].set(a[src - off]), pool)

  def copy(pool, src, dst):
    spec = layout.pool_spec
    pool_specs = jax.tree.map(lambda _: spec, pool)
    fn = jax.shard_map(local, mesh=layout.mesh, in_specs=(pool_specs, P(layout.rows),
                                                          P(layout.rows)),
                       out_specs=pool_specs, check_vma=False)
    return fn(pool, src, dst)

  return jit_pool_fn(copy, (layout.pool_sharding, layout.row_sharding, layout.row_sharding),
                     donate_argnums=(0,), out_shardings=layout.pool_sharding)


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


__all__ = ["NULL_PAGE", "PageAllocator", "PoolExhaustedError", "PoolLayout", "copy_pages",
           "gather_sequences", "init_pool", "make_copy_pages", "paged_prefill_attention",
           "pool_bytes", "write_tokens", "tree_pages"]
