"""The predictor's held-out prompts stay out of every step that trains the head, and the ensemble's
spread compares only heads fit alike.

What must hold: with `rl.predictor_holdout` > 0 the joint update's batch (both layouts, through
`ppo_loop.training_units` as the loop calls it) gives the nodes of exactly the prompts the fitter
holds out predictor weight 0 and every other node the weight it had without a holdout, everything
else bit for bit; with the default 0 nothing changes. The ensemble's (mean, variance) does not move
when the model's head is offset from the bootstrap members (the joint update's systematic gap), is
the members' own, and `ensemble=1` still returns the head's p̂ with no spread.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_batch import random_tree
from test_predictor_fit import _noisy_trees

from trace_jax.allocation.predictor_fit import PredictorFitter, held_out
from trace_jax.config import TrainConfig
from trace_jax.models.predictor import PredictorHead
from trace_jax.rl.ppo_loop import training_units
from trace_jax.rl.update import UpdateConfig, make_optimizers

SHARE = 0.4


def _forest(n=12, seed=3):
  """Random trees with distinct prompts, some of them in the held-out share and some not."""
  rng = np.random.default_rng(seed)
  trees = []
  for i in range(n):
    t = random_tree(rng, uid=i, rollouts=int(rng.integers(2, 6)))
    t.root.obs_ids[:] = [1000 + i, *t.root.obs_ids[1:]]  # distinct prompts
    trees.append(t)
  held = [held_out(t.prompt_ids, SHARE) for t in trees]
  assert 0 < sum(held) < len(trees)
  return trees, held


def _config(packing, holdout):
  c = TrainConfig()
  return dataclasses.replace(c, rl=dataclasses.replace(c.rl, packing=packing,
                                                       predictor_holdout=holdout))


def _seq_tree(trees):
  """build_sequences order: the tree index of every sequence (one per leaf)."""
  return [ti for ti, t in enumerate(trees) for _ in t.leaves()]


def _unit_entries(units, trees):
  """Every predictor entry of tree-packed units as (tree index, unit, pos, target, weight): the
  tree is read off the prompt tokens its entry's prompt span holds."""
  by_prompt = {tuple(t.prompt_ids): ti for ti, t in enumerate(trees)}
  out = []
  for ui, u in enumerate(units):
    for k in range(len(u["pred_pos"])):
      a, n = int(u["pred_pstart"][k]), int(u["pred_plen"][k])
      ti = by_prompt[tuple(int(x) for x in u["tokens"][a:a + n])]
      out.append((ti, ui, int(u["pred_pos"][k]), float(u["pred_target"][k]),
                  float(u["pred_weight"][k])))
  return out


def _same_except_predictor(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      if not k.startswith("pred_"):
        np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def test_joint_update_gives_held_out_prompts_no_predictor_weight_unpacked():
  trees, held = _forest()
  base = training_units(_config("none", 0.0), trees)
  got = training_units(_config("none", SHARE), trees)
  _same_except_predictor(base, got)
  owner = _seq_tree(trees)
  assert len(owner) == len(got)
  for ti, b, g in zip(owner, base, got):
    np.testing.assert_array_equal(g["pred_pos"], b["pred_pos"])
    np.testing.assert_array_equal(g["pred_target"], b["pred_target"])
    if held[ti]:
      assert not g["pred_weight"].any()
    else:
      np.testing.assert_array_equal(g["pred_weight"], b["pred_weight"])
  # Without the holdout the held-out prompts' nodes were trained: the fix removes real weight.
  assert sum(b["pred_weight"].sum() for ti, b in zip(owner, base) if held[ti]) > 0


def test_joint_update_gives_held_out_prompts_no_predictor_weight_tree_packed():
  trees, held = _forest()
  base = training_units(_config("tree", 0.0), trees)
  got = training_units(_config("tree", SHARE), trees)
  _same_except_predictor(base, got)
  want = [e for e in _unit_entries(base, trees) if not held[e[0]]]
  entries = _unit_entries(got, trees)
  assert entries == want  # the other prompts' entries unchanged, the held-out ones gone
  assert all(e[4] > 0 for e in entries)
  assert any(held[e[0]] for e in _unit_entries(base, trees))


@pytest.mark.parametrize("packing", ["none", "tree"])
def test_no_holdout_is_unchanged(packing):
  from trace_jax.rl.batch import build_sequences, build_tree_units

  trees, _ = _forest()
  got = training_units(_config(packing, 0.0), trees)
  c = _config(packing, 0.0)
  kw = dict(kind="tree_contrastive", max_depth=c.env.max_turns + 2, normalize=c.rl.normalize_std,
            pred_leaf_weight=c.rl.predictor_leaf_weight, values=c.rl.tree_values)
  if packing == "tree":
    from trace_jax.rl.ppo_loop import preds_per_row, row_len
    ref = build_tree_units(trees, row_len=row_len(c), max_nodes=preds_per_row(c),
                           cut_len=c.env.max_seq_len, **kw)[0]
  else:
    ref = build_sequences(trees, **kw)[0]
  assert c.method == "trace_tree"
  assert len(got) == len(ref)
  for x, y in zip(got, ref):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)
      assert np.asarray(x[k]).dtype == np.asarray(y[k]).dtype


def test_fitter_and_joint_update_hold_out_the_same_prompts():
  rs = np.random.RandomState(0)
  trees = _noisy_trees(rs, 40)
  g, s0 = nnx.split(PredictorHead(8, 16, rngs=nnx.Rngs(0)))
  fitter = PredictorFitter(g, make_optimizers(UpdateConfig())[1], steps=2, bucket=64,
                           holdout=SHARE, pred_state=s0)
  fitter.add(trees)
  _, info = fitter.fit(s0)
  seqs = training_units(_config("none", SHARE), trees)
  weighted = {tuple(trees[ti].prompt_ids) for ti, q in zip(_seq_tree(trees), seqs)
              if q["pred_weight"].any()}
  held = [t for t in trees if tuple(t.prompt_ids) not in weighted]
  # The fitter's held-out rows are these trees' roots (one feature each): the same prompts.
  assert info["predictor_fit_holdout_rows"] == len(held) > 0
  assert all(held_out(t.prompt_ids, SHARE) for t in held)
  # One function decides it for both (allocation's; rl imports it, not the other way round).
  from trace_jax.allocation import holdout, predictor_fit
  from trace_jax.rl import batch

  assert predictor_fit.held_out is holdout.held_out is batch.held_out


# ---- the ensemble's spread ----------------------------------------------------------------------
def _fitted(ensemble, seed=2):
  rs = np.random.RandomState(seed)
  g, s0 = nnx.split(PredictorHead(8, 32, rngs=nnx.Rngs(0)))
  tx = make_optimizers(UpdateConfig(predictor_lr=1e-2))[1]
  fitter = PredictorFitter(g, tx, steps=60, buffer_steps=1, bucket=64, ensemble=ensemble,
                           pred_state=s0)
  fitter.add(_noisy_trees(rs, 80))
  s, _ = fitter.fit(s0)
  return fitter, g, s, rs.randn(40, 8).astype(np.float32)


def _offset(s, logit):
  """The head `s` with its output logit shifted by `logit`: a head the joint update moved."""
  return jax.tree_util.tree_map_with_path(
      lambda path, a: a + logit if path[0].key == "b2" else a, s)


def test_spread_is_over_members_fit_alike_and_ignores_the_models_head_offset():
  fitter, g, s, x = _fitted(4)
  mean, var = fitter.spread(s, x)
  # The model's head far from the members (2 logits): the spread is the same.
  for off in (-2.0, 2.0):
    moved = _offset(s, off)
    assert np.abs(nnx.merge(g, moved).prob(x) - nnx.merge(g, s).prob(x)).mean() > 0.05
    m2, v2 = fitter.spread(moved, x)
    np.testing.assert_allclose(m2, mean, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(v2, var, rtol=1e-6, atol=1e-9)
  # It is the members' own moments (three bootstrap members, the unbiased variance).
  members = np.stack([
      np.asarray(nnx.merge(g, jax.tree.map(lambda a, i=i: a[i], fitter.members)).prob(x))
      for i in range(3)]).astype(np.float64)
  np.testing.assert_allclose(mean, members.mean(0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(var, members.var(0, ddof=1), rtol=1e-4, atol=1e-9)
  assert (var > 0).all()


def test_single_head_spread_unchanged_and_one_member_refused():
  fitter, g, s, x = _fitted(1)
  for head in (s, _offset(s, 1.0)):
    m, v = fitter.spread(head, x)
    np.testing.assert_array_equal(m, np.asarray(
        jax.jit(jax.vmap(lambda q, f: nnx.merge(g, q).prob(f), in_axes=(0, None)))(
            jax.tree.map(lambda a: jnp.asarray(a)[None], head),
            np.concatenate([x, np.zeros((24, 8), np.float32)]))[0, :40]))
    assert not v.any()
  with pytest.raises(ValueError, match="ensemble=2"):
    PredictorFitter(g, make_optimizers(UpdateConfig())[1], ensemble=2)
