"""Tree packing (`rl.packing=tree`): each tree's nodes computed once in the update, with the same
loss and gradients as one row segment per leaf.

What must hold: every packed token sees exactly its root path (its `prev` chain) and nothing else,
at the position it has on that path; every generated token is trained once with its node's
advantage; and for every advantage estimator the packed update's loss, metrics and gradients equal
the unpacked ones (f32, 1e-5 relative), on one device and on the 8-device mesh
(tests/scripts/tree_packing_mesh.py), and in the train loop's own step.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from devices import run_on_devices
from flax import nnx
from test_batch import hand_tree, random_tree

from trace_jax.models.predictor import PredictorHead
from trace_jax.models.qwen3 import Qwen3, get_preset
from trace_jax.rl.batch import (
  ADVANTAGES,
  build_sequences,
  build_tree_units,
  pack_batch,
  row_buckets,
)
from trace_jax.rl.update import UpdateConfig, init_train_state, make_grad_fn, reference_logprobs


def forest(seed=1, n=5):
  rng = np.random.default_rng(seed)
  return [random_tree(rng, uid=i, rollouts=int(rng.integers(2, 8))) for i in range(n)]


def packed(trees, kind="tree_contrastive", row_len=64, max_nodes=32, **kw):
  units, _, _ = build_tree_units(trees, kind, 8, row_len, max_nodes, **kw)
  return pack_batch(units, row_len, max_nodes, row_multiple=1)


def unpacked(trees, kind="tree_contrastive", row_len=64, **kw):
  seqs, _, _ = build_sequences(trees, kind, 8, **kw)
  return pack_batch(seqs, row_len, 16, row_multiple=1)


def test_row_buckets():
  assert row_buckets(80, 4) == list(range(4, 68, 4)) + [72, 80]
  assert row_buckets(4096, 8)[14:20] == [120, 128, 144, 168, 192, 216]
  assert row_buckets(10, 4) == [4, 8, 12]  # the cap rounded up to the multiple
  assert row_buckets(4, 8) == [8]


def _chain(b, r, q):
  out = [q]
  while b["prev"][r, out[-1]] != out[-1]:
    out.append(int(b["prev"][r, out[-1]]))
  return out[::-1]


@pytest.mark.parametrize("row_len", [64, 20])
def test_every_token_sees_exactly_its_root_path(row_len):
  """Follow `prev` from any token to its unit's first token: that chain's tokens are the root
  path's (some leaf's unpacked sequence starts with them), its length is the token's position,
  and the keys the ancestor mask lets the token see are exactly the chain."""
  trees = forest()
  b, info = packed(trees, row_len=row_len)
  paths = {tuple(t.path_tokens(leaf.id)[0][:row_len]) for t in trees for leaf in t.leaves()}
  real = b["segment_ids"] > 0
  idx = np.arange(row_len)
  for r in range(len(b["tokens"])):
    for q in np.nonzero(real[r])[0]:
      chain = _chain(b, r, q)
      toks = tuple(int(b["tokens"][r, k]) for k in chain)
      assert any(p[:len(toks)] == toks for p in paths), (r, q)
      assert b["positions"][r, q] == len(chain) - 1
      seen = (idx <= q) & (q < b["kv_end"][r]) & (b["segment_ids"][r] == b["segment_ids"][r, q])
      assert sorted(np.nonzero(seen)[0].tolist()) == sorted(chain), (r, q)
  # Computed once: fewer tokens than one segment per leaf, and only the ancestors of a split
  # unit's first leaf repeat.
  assert info["tokens"] < unpacked(trees, row_len=row_len)[1]["tokens"]


@pytest.mark.parametrize("kind", sorted(ADVANTAGES))
def test_same_trained_tokens_and_targets(kind):
  trees = forest(seed=3) + [hand_tree(9)]
  a, _ = unpacked(trees, kind, row_len=20, pred_leaf_weight=0.5)
  b, _ = packed(trees, kind, row_len=20, pred_leaf_weight=0.5)

  def trained(x):
    m = x["mask"] > 0
    return sorted(zip(x["tokens"][m].tolist(), np.round(x["adv"][m], 6).tolist(),
                      np.round(x["old_logp"][m], 6).tolist(), x["positions"][m].tolist()))
  assert trained(a) == trained(b)
  for k in ("pred_target",):
    wa, wb = a["pred_weight"] > 0, b["pred_weight"] > 0
    assert sorted(np.round(a[k][wa], 6)) == sorted(np.round(b[k][wb], 6))
  assert a["pred_weight"].sum() == pytest.approx(b["pred_weight"].sum())


def _setup(prompt_mean=False, seed=0):
  model = Qwen3(get_preset("tiny", vocab_size=100, num_layers=2), rngs=nnx.Rngs(seed))
  head = PredictorHead(model.cfg.hidden_size * (2 if prompt_mean else 1), 16,
                       rngs=nnx.Rngs(seed + 1))
  (g, p), (hg, hp) = nnx.split(model), nnx.split(head)
  return g, hg, p, hp


def _rel_err(x, y):
  return max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(a)) + 1e-30))
             for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y)))


@pytest.mark.parametrize("kind", sorted(ADVANTAGES))
@pytest.mark.parametrize("row_len,prompt_mean", [(64, False), (20, True)])
def test_packed_loss_and_gradients_equal_unpacked(kind, row_len, prompt_mean):
  """Random trees with forks below the root (stage-2 style), every estimator; with row_len 20
  long paths are cut and trees split over several units. A KL and an entropy term are on, so
  their normalizations are checked too."""
  g, hg, p, hp = _setup(prompt_mean)
  cfg = UpdateConfig(prompt_mean_features=prompt_mean, kl_coef=0.05, entropy_coef=0.01,
                     micro_batches=1)
  state = init_train_state(p, hp, cfg)
  ref = jax.tree.map(lambda x: x * 0.9 if jnp.issubdtype(x.dtype, jnp.floating) else x, p)
  trees = forest(seed=2)
  out = []
  for b, _ in (unpacked(trees, kind, row_len, pred_leaf_weight=0.5),
               packed(trees, kind, row_len, pred_leaf_weight=0.5)):
    b = dict(b, ref_logp=np.asarray(reference_logprobs(g, ref, b)))
    out.append(jax.jit(make_grad_fn(g, hg, cfg))(state, b))
  (l0, m0, g0), (l1, m1, g1) = out
  assert float(l1) == pytest.approx(float(l0), rel=1e-5)
  for k in ("pg_loss", "kl_ref", "entropy", "predictor_bce", "num_tokens", "approx_kl"):
    assert float(m1[k]) == pytest.approx(float(m0[k]), rel=1e-5, abs=1e-7), k
  assert _rel_err(g0, g1) < 1e-5
  assert float(m0["kl_ref"]) > 0 and float(m0["num_tokens"]) > 0  # the terms are really on


def test_longer_packed_rows_cut_paths_where_the_unpacked_rows_end():
  """`rl.pack_row_len` above `env.max_seq_len`: rows of 64 keep whole trees, paths still cut at
  20 as in 20-token unpacked rows; same loss and gradients, fewer tokens computed."""
  g, hg, p, hp = _setup()
  cfg = UpdateConfig()
  state = init_train_state(p, hp, cfg)
  trees = forest(seed=6)
  a, ia = unpacked(trees, "tree_grpo", 20)
  units, _, _ = build_tree_units(trees, "tree_grpo", 8, 64, 64, cut_len=20)
  b, ib = pack_batch(units, 64, 64, row_multiple=1)
  assert ia["cut_sequences"] > 0 and ib["tokens"] < packed(trees, "tree_grpo", 20)[1]["tokens"]
  (l0, m0, g0), (l1, m1, g1) = [jax.jit(make_grad_fn(g, hg, cfg))(state, x) for x in (a, b)]
  assert float(l1) == pytest.approx(float(l0), rel=1e-5)
  assert float(m1["num_tokens"]) == float(m0["num_tokens"])
  assert _rel_err(g0, g1) < 1e-5


def test_packed_micro_batches_sum_to_the_full_batch():
  g, hg, p, hp = _setup()
  trees = forest(seed=4, n=8)
  b, _ = packed(trees, "grpo", 32)
  rows = -(-len(b["tokens"]) // 4) * 4
  units, _, _ = build_tree_units(trees, "grpo", 8, 32, 32)
  b, _ = pack_batch(units, 32, 32, num_rows=rows)
  res = [jax.jit(make_grad_fn(g, hg, UpdateConfig(micro_batches=m)))(
      init_train_state(p, hp, UpdateConfig()), b) for m in (1, 4)]
  assert float(res[1][0]) == pytest.approx(float(res[0][0]), rel=1e-5)
  assert _rel_err(res[0][2], res[1][2]) < 1e-5


def test_bucketed_rows_and_node_cap():
  trees = forest(seed=5, n=6)
  units, _, _ = build_tree_units(trees, "grpo", 8, 48, 6)
  assert all(len(u["tokens"]) <= 48 and len(u["pred_pos"]) <= 6 for u in units)
  b, info = pack_batch(units, 48, 6, buckets=[2, 4, 8, 64])
  assert len(b["tokens"]) == next(x for x in [2, 4, 8, 64] if x >= info["rows"])
  assert info["dropped_sequences"] == 0
  b, info = pack_batch(units, 48, 6, buckets=[1])  # past the last bucket: dropped and counted
  assert len(b["tokens"]) == 1 and 0 < info["dropped_sequences"] < len(units)


def test_packed_gradients_on_the_8_device_mesh():
  res = run_on_devices("tree_packing_mesh.py")
  assert res["devices"] == 8
  assert res["loss_rel_err"] < 1e-5 and res["grad_rel_err"] < 1e-5, res
  assert res["packed_tokens"] < res["unpacked_tokens"]


@pytest.mark.slow
def test_train_step_packed_equals_unpacked(tmp_path, tmp_path_factory):
  """The smoke config's first RL step, one sample, both layouts of the train loop
  (`training_units` + `pack_rows` + the run's jitted update): same loss, gradient norm, tokens;
  and the tree layout with blocked attention (`rl.attention=blocked`: block lists in the batch)
  equal to it with the dense mask."""
  from test_train_smoke import draw_outcomes, smoke_config

  from trace_jax import train

  c = smoke_config(tmp_path_factory, tmp_path / "run", rl__packing="tree")
  run = train.build(c)
  state = train.init_state(run)
  sample, rec = train.sample_step(run, state)
  draw_outcomes(sample.trees)
  out = {}
  for packing, attention in (("none", "dense"), ("tree", "dense"), ("tree", "blocked")):
    cp = c.replace(rl=c.rl.__class__(**{**c.rl.__dict__, "packing": packing,
                                         "attention": attention}))
    units = train.training_units(cp, sample.trees)
    batch, info = train.pack_rows(cp, run.mesh, units)
    assert ("kv_blocks" in batch) == (attention == "blocked")
    ts = jax.tree.map(jnp.copy, state.train)
    _, m = run.update(ts, batch)
    out[packing, attention] = (jax.device_get(m), info)
  (m0, i0), (m1, i1) = out["none", "dense"], out["tree", "dense"]
  m2 = out["tree", "blocked"][0]
  for k in ("loss", "grad_norm", "num_tokens", "predictor_bce", "pg_loss"):
    assert float(m1[k]) == pytest.approx(float(m0[k]), rel=1e-4, abs=1e-7), k
    assert float(m2[k]) == pytest.approx(float(m1[k]), rel=1e-5, abs=1e-7), k
  assert float(m0["grad_norm"]) > 0 and float(m0["pg_loss"]) != 0
  assert i1["tokens"] < i0["tokens"] and i1["padded_rows"] <= i0["padded_rows"]


def test_packing_options_are_checked():

  from configs import mhqa
  from trace_jax import train

  c = mhqa.get_config("tiny")
  c.rl.packing = "trees"
  with pytest.raises(ValueError, match="rl.packing"):
    mhqa.validate(c)
  c.rl.packing, c.rl.pack_row_len = "tree", 100
  with pytest.raises(ValueError, match="pack_row_len"):
    mhqa.validate(c)
  c.rl.pack_row_len = 1536
  t = mhqa.validate(c)
  assert train.row_len(t) == 1536 and train.preds_per_row(t) == 4 * train.preds_per_row(
      mhqa.validate(mhqa.get_config("tiny")))
