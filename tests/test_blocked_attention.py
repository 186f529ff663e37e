"""Block-sparse attention for packed tree rows (`trace_jax.models.blocked_attention`).

What must hold: the host's block lists hold exactly the key blocks some query of a query block may
see under the dense mask (never fewer, and for contiguous segments never more); the blocked
attention equals the dense masked attention in outputs and in gradients (f32, 1e-5 relative) on
random trees with single-token nodes, deep chains, several trees per row, pad tokens, rows that are
not whole blocks and GQA; its largest intermediate follows the listed blocks, not [T, T]; and the
decoder's forward and the update's step give what the dense path gives.
"""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.models.attention import dense_attention
from trace_jax.models.blocked_attention import (
  block_size_for,
  blocked_attention,
  dense_tree_mask,
  kv_block_lists,
  list_width,
  visible_block_fraction,
)


def tree_row(rng, t, *, max_len=6, single=0.3, chain=False, trees=1, pad=0):
  """One packed row of `trees` random trees in preorder (as `rl.batch.pack_batch` lays them out):
  node lengths 1..max_len (1 with probability `single`), each new node a child of a random node on
  the current root path (always the last one with `chain`); kv_end of a node's tokens is the end
  of its subtree; tree s is segment s; the last `pad` slots are padding (kv_end = i + 1, segment 0).
  Returns (kv_end i32[T], segment_ids i32[T])."""
  kv_end = np.arange(1, t + 1, dtype=np.int32)
  seg = np.zeros(t, np.int32)
  room = t - pad
  bounds = np.sort(rng.choice(np.arange(1, room), trees - 1, replace=False)) if trees > 1 else []
  starts = [0, *bounds, room]
  for s in range(trees):
    at, stop = starts[s], starts[s + 1]
    path, nodes = [], []  # [first, own end, subtree end] per node; ends rise as nodes come
    while at < stop:
      n = 1 if rng.random() < single else int(rng.integers(1, max_len + 1))
      n = min(n, stop - at)
      if path and not chain:
        del path[int(rng.integers(1, len(path) + 1)):]
      nodes.append([at, at + n, at + n])
      for p in path:
        nodes[p][2] = at + n
      path.append(len(nodes) - 1)
      at += n
    for first, own, end in nodes:
      kv_end[first:own] = end
    seg[starts[s]:stop] = s + 1
  return kv_end, seg


def _rows(seed, t, n=3, **kw):
  rng = np.random.default_rng(seed)
  rows = [tree_row(rng, t, **kw) for _ in range(n)]
  return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])


def _qkv(seed, b, t, h=4, hkv=2, d=16):
  ks = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(ks[0], (b, t, h, d)), jax.random.normal(ks[1], (b, t, hkv, d)),
          jax.random.normal(ks[2], (b, t, hkv, d)))


def _rel(a, b):
  return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))


LAYOUTS = {  # name: (row length, tree_row options, block)
    "single_token_nodes": (96, dict(single=0.9, max_len=3), 16),
    "deep_chain": (128, dict(chain=True, max_len=5), 16),
    "several_trees": (120, dict(trees=4, pad=7), 16),  # 120 = 7.5 blocks of 16
    "bushy_long": (256, dict(max_len=12, single=0.1, trees=2, pad=20), 32),
}


def test_tree_rows_are_trees():
  """The generator's rows: kv_end is the end of each token's subtree and nests."""
  kv, seg = _rows(0, 64, n=4, trees=2, pad=5)
  for r in range(4):
    for i in range(64):
      assert i < kv[r, i] <= 64
      j = np.arange(i, kv[r, i])
      assert np.all(kv[r, j] <= kv[r, i]) and np.all(seg[r, j] == seg[r, i])


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_block_lists_are_the_visible_blocks(name):
  t, kw, block = LAYOUTS[name]
  kv, seg = _rows(1, t, **kw)
  blocks, counts = kv_block_lists(kv, seg, block=block)
  nq = -(-t // block)
  blk = block_size_for(t, nq)
  assert blocks.shape[:2] == (3, nq) and counts.shape == (3, nq)
  mask = np.asarray(dense_tree_mask(t, jnp.asarray(kv), jnp.asarray(seg)))
  mp = np.zeros((3, nq * blk, nq * blk), bool)
  mp[:, :t, :t] = mask
  want = mp.reshape(3, nq, blk, nq, blk).any((2, 4))
  for r in range(3):
    for q in range(nq):
      got = blocks[r, q, :counts[r, q]]
      assert list(got) == sorted(set(got.tolist()))
      assert set(got.tolist()) == set(np.nonzero(want[r, q])[0].tolist()), (r, q)
  # a chain sees its whole past; a tree row skips blocks
  frac = visible_block_fraction(counts)
  assert frac == 1.0 if name == "deep_chain" else frac < 0.9, frac
  assert blocks.shape[2] == min(list_width(int(counts.max())), nq)


def test_list_width():
  assert [list_width(n) for n in range(1, 11)] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 10]
  assert [list_width(n) for n in (17, 21, 33, 100)] == [20, 24, 40, 112]
  assert all(n <= list_width(n) < n * 1.25 + 1 for n in range(1, 300))


def test_max_blocks():
  kv, seg = _rows(2, 64, chain=True)
  _, counts = kv_block_lists(kv, seg, block=8)
  blocks, _ = kv_block_lists(kv, seg, block=8, max_blocks=8)
  assert blocks.shape[2] == 8
  with pytest.raises(ValueError, match="max_blocks"):
    kv_block_lists(kv, seg, block=8, max_blocks=int(counts.max()) - 1)


def _both(name, seed=0, chunk=None, h=4, hkv=2):
  t, kw, block = LAYOUTS[name]
  kv, seg = _rows(seed, t, **kw)
  blocks, counts = kv_block_lists(kv, seg, block=block)
  q, k, v = _qkv(seed, 3, t, h, hkv)
  kv, seg = jnp.asarray(kv), jnp.asarray(seg)
  mask = dense_tree_mask(t, kv, seg)

  def dense(q, k, v):
    return dense_attention(q, k, v, mask)

  def blocked(q, k, v):
    return blocked_attention(q, k, v, jnp.asarray(blocks), jnp.asarray(counts), kv, seg,
                             chunk=chunk)
  return dense, blocked, (q, k, v)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("chunk", [None, 1, 3])
def test_outputs_equal_dense(name, chunk):
  dense, blocked, args = _both(name, chunk=chunk)
  want, got = jax.jit(dense)(*args), jax.jit(blocked)(*args)
  assert _rel(got, want) < 1e-5
  assert float(jnp.max(jnp.abs(want))) > 0.1  # real values, not zeros


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (6, 1)])
def test_gradients_equal_dense(name, heads):
  dense, blocked, args = _both(name, seed=3, chunk=2 if heads == (4, 2) else None, h=heads[0],
                               hkv=heads[1])
  w = jax.random.normal(jax.random.key(9), args[0].shape)

  def loss(f):
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) * w), argnums=(0, 1, 2)))
  for gw, gb in zip(loss(dense)(*args), loss(blocked)(*args)):
    assert _rel(gb, gw) < 1e-5
    assert float(jnp.max(jnp.abs(gw))) > 1e-3


def test_a_wrong_block_list_shows():
  """The equality tests can fail: dropping one listed block (or one count) changes the output."""
  t, kw, block = LAYOUTS["deep_chain"]
  kv, seg = _rows(0, t, **kw)
  blocks, counts = kv_block_lists(kv, seg, block=block)
  q, k, v = _qkv(0, 3, t)
  want = dense_attention(q, k, v, dense_tree_mask(t, jnp.asarray(kv), jnp.asarray(seg)))
  short = counts.copy()
  short[0, -1] -= 1  # the last query block loses its last listed key block (its own)
  got = blocked_attention(q, k, v, jnp.asarray(blocks), jnp.asarray(short), jnp.asarray(kv),
                          jnp.asarray(seg))
  assert _rel(got, want) > 1e-3


def _largest_intermediate(f, *args):
  jaxpr = jax.make_jaxpr(f)(*args)
  sizes = []

  def walk(jx):
    for eqn in jx.eqns:
      sizes.extend(int(np.prod(o.aval.shape)) for o in eqn.outvars)
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)
  walk(jaxpr.jaxpr)
  return max(sizes)


def test_memory_follows_the_listed_blocks():
  """Forward and backward on rows of 512 tokens holding 12 trees, in blocks of 16: the largest
  intermediate is the gathered score tile [B, H, T, M * blk], a quarter of the dense scores or
  less."""
  t, block, b, h = 512, 16, 2, 4
  rng = np.random.default_rng(5)
  rows = [tree_row(rng, t, max_len=12, single=0.0, trees=12) for _ in range(b)]
  kv, seg = np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
  blocks, counts = kv_block_lists(kv, seg, block=block)
  q, k, v = _qkv(1, b, t, h, 2)
  args = (jnp.asarray(blocks), jnp.asarray(counts), jnp.asarray(kv), jnp.asarray(seg))

  def loss(q, k, v):
    return jnp.sum(blocked_attention(q, k, v, *args))
  biggest = _largest_intermediate(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
  dense = b * h * t * t
  width = blocks.shape[2]
  assert biggest <= b * h * t * width * block <= dense // 4, (biggest, dense, width)


# ---- in the model and the update -----------------------------------------------------------------
def _tiny_update(prompt_mean=True):
  from flax import nnx

  from trace_jax.models.predictor import PredictorHead
  from trace_jax.models.qwen3 import Qwen3, get_preset

  model = Qwen3(get_preset("tiny", vocab_size=100, num_layers=2), rngs=nnx.Rngs(0))
  head = PredictorHead(model.cfg.hidden_size * (2 if prompt_mean else 1), 16, rngs=nnx.Rngs(1))
  return nnx.split(model), nnx.split(head)


def _bool_square_masks(f, t, *args):
  """The bool [B, T, T] arrays of f's jaxpr (the dense path's attention mask)."""
  out = []

  def walk(jx):
    for eqn in jx.eqns:
      out.extend(o.aval.shape for o in eqn.outvars
                 if o.aval.dtype == jnp.bool_ and o.aval.shape[1:] == (t, t))
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)
  walk(jax.make_jaxpr(f)(*args).jaxpr)
  return out


@pytest.mark.parametrize("row_len,cut", [(64, 64), (256, 48)])
def test_update_blocked_equals_dense(row_len, cut):
  """The update's loss, metrics and gradients (policy and predictor, prompt-mean features, a KL
  term whose reference log-probs take the same path, two micro-batches) with the block lists in
  the batch equal the dense ones, on tree-packed random forests; rows of 256 hold whole trees.
  With the lists in, the update's program holds no [T, T] mask."""
  from test_tree_packing import forest

  from trace_jax.rl.batch import build_tree_units, pack_batch
  from trace_jax.rl.ppo_loop import with_block_lists
  from trace_jax.rl.update import UpdateConfig, init_train_state, make_grad_fn, reference_logprobs

  (g, p), (hg, hp) = _tiny_update()
  cfg = UpdateConfig(prompt_mean_features=True, kl_coef=0.05, entropy_coef=0.01, micro_batches=2)
  state = init_train_state(p, hp, cfg)
  ref = jax.tree.map(lambda x: x * 0.9 if jnp.issubdtype(x.dtype, jnp.floating) else x, p)
  units, _, _ = build_tree_units(forest(seed=3, n=8), "tree_contrastive", 8, row_len, 64,
                                 cut_len=cut)
  dense, _ = pack_batch(units, row_len, 64, row_multiple=2)
  blocked, info = with_block_lists(dense, {})
  assert 0 < info["attention_blocks"] < 1 if row_len > 64 else info["attention_blocks"] == 1
  out = []
  for b in (dense, blocked):
    ref_logp = np.asarray(reference_logprobs(g, ref, b, micro_batches=2))
    out.append((ref_logp, jax.jit(make_grad_fn(g, hg, cfg))(state, dict(b, ref_logp=ref_logp))))
  (r0, (l0, m0, g0)), (r1, (l1, m1, g1)) = out
  assert np.max(np.abs(r1 - r0)) <= 1e-5 * np.max(np.abs(r0)) and np.max(np.abs(r0)) > 0
  assert float(l1) == pytest.approx(float(l0), rel=1e-5)
  for k in ("pg_loss", "kl_ref", "entropy", "predictor_bce", "num_tokens"):
    assert float(m1[k]) == pytest.approx(float(m0[k]), rel=1e-5, abs=1e-7), k
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    assert _rel(b, a) < 1e-5
  assert float(m0["kl_ref"]) > 0
  grads = make_grad_fn(g, hg, cfg)
  assert _bool_square_masks(grads, row_len, state, dict(dense, ref_logp=r0))
  assert not _bool_square_masks(grads, row_len, state, dict(blocked, ref_logp=r0))


# The train loop's own step (pack_rows + the jitted update) blocked against dense:
# tests/test_tree_packing.py::test_train_step_packed_equals_unpacked.
