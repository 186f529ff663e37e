"""Paged KV pool: allocator, page ops, prefill attention, and the decode attention tables."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from trace_jax.kernels import paged_attention_reference, tree_attention_reference
from trace_jax.models.qwen3.model import dense_attention
from trace_jax.sampling.paged_kv import (PageAllocator, PoolExhaustedError, copy_pages,
                                        gather_sequences, init_pool, paged_prefill_attention,
                                        pool_bytes, write_tokens)
from trace_jax.sampling.slot_tables import (SlotView, page_buckets, pick_bucket, plain_tables,
                                           sharded_tables, tree_tables)


def test_allocator_refcounts():
  a = PageAllocator(8)
  assert a.num_free == a.capacity == 7
  p = a.alloc(3)
  assert 0 not in p and a.num_free == 4 and (a.refcount[p] == 1).all()
  a.incref(p[:2])
  a.decref(p)
  assert a.num_free == 5 and list(a.refcount[p]) == [1, 1, 0]
  a.decref(p[:2])
  assert a.num_free == 7 and not a.refcount.any()
  with pytest.raises(ValueError, match="double free"):
    a.decref([p[0]])
  with pytest.raises(ValueError):
    a.incref([p[0]])
  a.alloc(7)
  with pytest.raises(PoolExhaustedError, match="need 1 pages, 0 of 7 free"):
    a.alloc(1)
  with pytest.raises(ValueError):
    PageAllocator(1)


def test_allocator_shards_keep_their_page_ranges():
  a = PageAllocator(12, shards=3)  # ranges [0, 4), [4, 8), [8, 12); null pages 0, 4, 8
  assert a.capacity == 9 and [a.null_page(s) for s in range(3)] == [0, 4, 8]
  p1, p2 = a.alloc(3, 1), a.alloc(2, 2)
  assert sorted(p1) == [5, 6, 7] and sorted(p2) == [9, 10]
  assert a.num_free_in(1) == 0 and a.num_free == 4 and {a.shard_of(p) for p in p1} == {1}
  with pytest.raises(PoolExhaustedError, match="0 of 3 of shard 1 free"):
    a.alloc(1, 1)
  a.decref(p1[:1])
  assert a.alloc(1, 1) == p1[:1]  # freed pages return to their own shard
  with pytest.raises(ValueError, match="does not split"):
    PageAllocator(10, shards=3)


def test_sharded_tables_pad_with_each_shards_null_page():
  # 2 shards of 10 pages, 2 slots each. Shard 0: one lone slot; shard 1: two forked siblings.
  views = [SlotView([1, 2, 3], 10), None,
           SlotView([11, 12, 14], 11, "a", 2), SlotView([11, 12, 15, 16], 14, "a", 2)]
  t = sharded_tables(views, 2, 10, 4, 1, 2, (2, 4, 8))
  np.testing.assert_array_equal(t["group_slots"], [[-1, -1], [2, 3]])  # global slot ids
  np.testing.assert_array_equal(t["group_pages"], [[0, 0], [11, 12]])
  np.testing.assert_array_equal(t["group_lens"], [0, 8])
  # Widths: the widest bucket any shard needs; padding points at the row's own null page.
  np.testing.assert_array_equal(t["suffix_pages"], [[1, 2, 3, 0], [0, 0, 0, 0],
                                                    [14, 10, 10, 10], [15, 16, 10, 10]])
  np.testing.assert_array_equal(t["suffix_lens"], [10, 0, 3, 6])
  p = sharded_tables(views, 2, 10, 4, 1, 2, (2, 4, 8), tree=False)
  assert not p["group_lens"].any() and (p["group_slots"] == -1).all()
  np.testing.assert_array_equal(p["suffix_pages"][2:], [[11, 12, 14, 10], [11, 12, 15, 16]])
  np.testing.assert_array_equal(p["suffix_lens"], [10, 0, 11, 14])


def test_pool_write_copy_gather():
  pool = init_pool(2, 6, 4, 2, 8)
  assert pool_bytes(pool) == 2 * 2 * 6 * 4 * 2 * 8 * 4
  x = jax.random.normal(jax.random.key(0), (3, 2, 8))
  k = write_tokens(pool["k"][1], x, jnp.array([2, 2, 3]), jnp.array([0, 3, 1]))
  np.testing.assert_array_equal(k[2, 0], x[0])
  np.testing.assert_array_equal(k[3, 1], x[2])
  pool["k"][1] = k
  pool = copy_pages(pool, jnp.array([2, 0]), jnp.array([5, 0]))
  np.testing.assert_array_equal(pool["k"][1][5], pool["k"][1][2])
  assert not pool["k"][0].any() and not pool["v"][1].any()
  seq = gather_sequences(pool["k"][1], jnp.array([[2, 3], [5, 0]]))
  assert seq.shape == (2, 8, 2, 8)
  np.testing.assert_array_equal(seq[0, 5], x[2])
  np.testing.assert_array_equal(seq[1, 3], x[1])


def test_prefill_attention_matches_dense():
  rng = np.random.default_rng(0)
  b, c, h, hkv, d, ps = 2, 5, 4, 2, 8, 4
  # Row 0: 3 earlier tokens then 5 new ones; row 1: 0 earlier, 2 new (right padded).
  total = [8, 2]
  start = jnp.array([3, 0])
  num_new = jnp.array([5, 2])
  table = jnp.array([[3, 1, 0], [2, 0, 0]])
  kseq = jnp.asarray(rng.normal(size=(b, 12, hkv, d)), jnp.float32)
  vseq = jnp.asarray(rng.normal(size=(b, 12, hkv, d)), jnp.float32)
  kp = jnp.zeros((4, ps, hkv, d))
  vp = jnp.zeros((4, ps, hkv, d))
  for r in range(b):
    for t in range(total[r]):
      kp = kp.at[table[r, t // ps], t % ps].set(kseq[r, t])
      vp = vp.at[table[r, t // ps], t % ps].set(vseq[r, t])
  q = jnp.asarray(rng.normal(size=(b, c, h, d)), jnp.float32)
  out = paged_prefill_attention(q, kp, vp, table, start, num_new)
  for r in range(b):
    n, s0 = int(num_new[r]), int(start[r])
    qpos = s0 + jnp.arange(n)
    mask = (jnp.arange(s0 + n)[None, :] <= qpos[:, None])[None]
    ref = dense_attention(q[r:r + 1, :n], kseq[r:r + 1, :s0 + n], vseq[r:r + 1, :s0 + n], mask)
    np.testing.assert_allclose(out[r, :n], ref[0], atol=1e-5)
  assert np.isfinite(np.asarray(out)).all()


def test_buckets():
  assert page_buckets(24) == (4, 8, 16, 24)
  assert page_buckets(3) == (3,)
  assert page_buckets(24, (8, 2)) == (2, 8, 24)
  assert pick_bucket(5, (4, 8, 16)) == 8
  with pytest.raises(ValueError):
    pick_bucket(17, (4, 8, 16))


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 3), st.integers(1, 3))
def test_tree_tables_equal_plain_attention(seed, max_groups, group_size):
  """Random families of forked slots: grouped tree attention = per-slot paged attention."""
  rng = np.random.default_rng(seed)
  ps, num_pages, s, hq, hkv, d = 4, 64, 6, 4, 2, 8
  free = list(rng.permutation(np.arange(1, num_pages)))
  anchors = []
  for _ in range(2):
    n = int(rng.integers(1, 14))
    anchors.append((free[:-(-n // ps)], n))
    del free[:-(-n // ps)]
  slots = []
  for i in range(s):
    if rng.random() < 0.2:
      slots.append(None)
      continue
    a = int(rng.integers(0, 3))
    if a == 2:  # unforked slot: all pages its own
      n = int(rng.integers(1, 15))
      slots.append(SlotView(free[:-(-n // ps)], n))
      del free[:-(-n // ps)]
      continue
    pages, n = anchors[a]
    full = n // ps
    extra = int(rng.integers(1, 9))
    own = free[:-(-(n - full * ps + extra) // ps)]
    del free[:len(own)]
    slots.append(SlotView(list(pages[:full]) + own, n + extra, ("a", a), full))
  buckets = (2, 4, 8)
  kp = jnp.asarray(rng.normal(size=(num_pages, ps, hkv, d)), jnp.float32)
  vp = jnp.asarray(rng.normal(size=(num_pages, ps, hkv, d)), jnp.float32)
  q = jnp.asarray(rng.normal(size=(s, hq, d)), jnp.float32)
  tt = tree_tables(slots, ps, max_groups, group_size, buckets)
  pt = plain_tables(slots, buckets)
  assert tt["group_slots"].shape == (max_groups, group_size)
  a = tree_attention_reference(q, kp, vp, tt["group_pages"], tt["group_lens"], tt["group_slots"],
                               tt["suffix_pages"], tt["suffix_lens"])
  b = paged_attention_reference(q, kp, vp, pt["page_table"], pt["lens"])
  np.testing.assert_allclose(a, b, atol=1e-5)
  for i, v in enumerate(slots):
    if v is None:
      assert pt["lens"][i] == 0 and tt["suffix_lens"][i] == 0
