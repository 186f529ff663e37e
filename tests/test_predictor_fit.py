import numpy as np
import pytest
from flax import nnx

from trace_jax.models.predictor import PredictorHead
from trace_jax.allocation.predictor_fit import PredictorFitter, node_examples
from trace_jax.sampling.tree import rollout_start_depths, rollout_values
from trace_jax.allocation.predictor_metrics import auc
from trace_jax.rl.update import UpdateConfig, make_optimizers
from trace_jax.sampling.tree import Tree


def _trees(rs, n):
  """Chains whose root feature's first coordinate decides success."""
  trees = []
  for _ in range(n):
    f = rs.randn(8).astype(np.float32)
    t = Tree([1])
    t.root.feature = f
    leaf = t.add_node(0, done=True, reward=float(f[0] > 0))
    assert leaf.id == 1
    trees.append(t)
  return trees


def test_node_examples_take_backed_up_values():
  t = Tree([1])
  t.root.feature = np.ones(3, np.float32)
  a = t.add_node(0, feature=np.zeros(3, np.float32))
  t.add_node(a.id, done=True, reward=1.0)  # no feature: left out
  t.add_node(a.id, done=True, reward=0.0, feature=np.ones(3, np.float32))
  x, y = node_examples([t])
  assert x.shape == (3, 3) and sorted(y.tolist()) == [0.0, 0.5, 0.5]


def test_fitter_learns_a_separable_signal_from_a_replay_buffer():
  rs = np.random.RandomState(0)
  head = PredictorHead(8, 32, rngs=nnx.Rngs(0))
  g, s = nnx.split(head)
  tx = make_optimizers(UpdateConfig(predictor_lr=1e-2))[1]
  opt = tx.init(s)
  fitter = PredictorFitter(g, tx, steps=100, buffer_steps=2, bucket=64)
  for _ in range(3):
    fitter.add(_trees(rs, 100))
  assert len(fitter.buffer) == 2
  s, opt, info = fitter.fit(s, opt)
  assert info["predictor_fit_bce_last"] < info["predictor_fit_bce_first"] - 0.1
  test = _trees(rs, 200)
  feats = np.stack([t.root.feature for t in test])
  p = np.asarray(nnx.merge(g, s).prob(feats))
  assert auc(p, np.asarray([t.nodes[1].reward for t in test])) > 0.9


def test_visit_weighting_weighs_nodes_by_leaf_count():
  t = Tree([1])
  t.root.feature = np.ones(3, np.float32)
  a = t.add_node(0, feature=np.zeros(3, np.float32))
  for r in (1.0, 0.0, 0.0):
    t.add_node(a.id, done=True, reward=r, feature=np.ones(3, np.float32))
  x, y, n, root, leaf = node_examples([t], with_meta=True)
  assert n.tolist() == [3.0, 3.0, 1.0, 1.0, 1.0]
  assert root.tolist() == [True, False, False, False, False]
  assert leaf.tolist() == [False, False, True, True, True]
  tx = make_optimizers(UpdateConfig())[1]
  g = nnx.split(PredictorHead(3, 4, rngs=nnx.Rngs(0)))[0]
  visits = PredictorFitter(g, tx, weighting="visits", leaf_weight=1.0)
  visits.add([t])
  assert visits.roots[0][2].tolist() + visits.buffer[0][2].tolist() == n.tolist()
  uniform = PredictorFitter(g, tx, leaf_weight=1.0)
  uniform.add([t])
  assert uniform.roots[0][2].tolist() + uniform.buffer[0][2].tolist() == [1.0] * 5
  # By default leaves (never queried at allocation) weigh nothing.
  default = PredictorFitter(g, tx, weighting="visits")
  default.add([t])
  assert default.roots[0][2].tolist() + default.buffer[0][2].tolist() == [3.0, 3.0, 0, 0, 0]
  with pytest.raises(ValueError, match="weighting"):
    PredictorFitter(g, tx, weighting="depth")


def test_roots_can_be_kept_longer_than_other_nodes():
  rs = np.random.RandomState(1)
  g = nnx.split(PredictorHead(8, 4, rngs=nnx.Rngs(0)))[0]
  fitter = PredictorFitter(g, make_optimizers(UpdateConfig())[1], buffer_steps=2,
                           root_buffer_steps=5)
  for _ in range(6):
    trees = _trees(rs, 10)
    for t in trees:
      t.nodes[1].feature = rs.randn(8).astype(np.float32)
    fitter.add(trees)
  assert len(fitter.buffer) == 2 and len(fitter.roots) == 5
  assert sum(len(b[1]) for b in fitter.buffer) == 20  # the leaves of the last two steps
  assert sum(len(b[1]) for b in fitter.roots) == 50   # the roots of the last five


def test_roots_are_refeaturized_under_the_current_policy():
  """With `root_features`, every fit recomputes the buffered roots' features from their prompts:
  a head fit on refreshed features that separate the outcomes learns them, although the features
  recorded at sampling time (noise) carry nothing."""
  rs = np.random.RandomState(2)
  calls = []

  def root_features(prompts):
    calls.append(len(prompts))
    return np.asarray([[4.0 if p[0] == 1 else -4.0] + [0.0] * 7 for p in prompts], np.float32)

  trees = []
  for i in range(40):
    t = Tree([i % 2, 7])  # prompt [1, 7] succeeds, [0, 7] fails
    t.root.feature = rs.randn(8).astype(np.float32)
    t.add_node(0, done=True, reward=float(i % 2))
    trees.append(t)
  head = PredictorHead(8, 16, rngs=nnx.Rngs(0))
  g, s = nnx.split(head)
  tx = make_optimizers(UpdateConfig(predictor_lr=1e-2))[1]
  fitter = PredictorFitter(g, tx, steps=60, bucket=64, root_features=root_features)
  fitter.add(trees[:20])
  fitter.add(trees[20:])
  s, _, _ = fitter.fit(s, tx.init(s))
  assert calls == [40]
  p = np.asarray(nnx.merge(g, s).prob(root_features([[1, 7], [0, 7]])))
  assert p[0] > 0.8 and p[1] < 0.2, p


def test_targets_count_only_rollouts_started_at_or_above():
  """Root: two stage-1 rollouts (0 and 0); three continuations forked at n1 (all 1) count for n1
  but not for the root, whose target stays 0 with 2 counted leaves (visit weight 2, not 5)."""
  t = Tree([1])
  t.root.feature = np.ones(3, np.float32)
  a = t.add_node(0, feature=np.zeros(3, np.float32), rollout=0)
  t.add_node(a.id, done=True, reward=0.0, rollout=0)
  t.add_node(0, done=True, reward=0.0, rollout=1)
  for r in range(2, 5):
    t.add_node(a.id, done=True, reward=1.0, rollout=r)
  values, counts = rollout_values(t)
  assert values[0] == 0.0 and counts[0] == 2
  # n1's own target: the stage-1 outcome through it (the forks were placed because of it);
  # pooled (for visit weighting, where each leaf is one observation) it counts the forks too.
  assert values[a.id] == 0.0 and counts[a.id] == 1
  assert rollout_values(t, per_leaf=True)[0][a.id] == pytest.approx(0.75)
  assert rollout_start_depths(t) == [-1, 0, 0, 0, 1, 1, 1]
  x, y, n, root, _ = node_examples([t], with_meta=True)
  assert y.tolist()[:2] == [0.0, 0.0] and n.tolist()[:2] == [2.0, 1.0]
  _, y, n, _, _ = node_examples([t], with_meta=True, per_leaf=True)
  assert y.tolist()[:2] == [0.0, 0.75] and n.tolist()[:2] == [2.0, 4.0]
  t.backup()
  assert t.root.value == pytest.approx(0.6)  # what the biased target would have been


def test_fitter_has_its_own_optimizer_state():
  """The fitter steps its own Adam state, never the one passed by the older call (the joint
  update's), and `state_dict` / `load_state_dict` round-trip it: a restored fitter continues
  exactly like the original."""
  import jax
  rs = np.random.RandomState(3)
  g, s0 = nnx.split(PredictorHead(8, 16, rngs=nnx.Rngs(0)))
  tx = make_optimizers(UpdateConfig(predictor_lr=1e-2))[1]
  joint = tx.init(s0)
  fitter = PredictorFitter(g, tx, steps=5, bucket=64, pred_state=s0)
  trees = _trees(rs, 40)
  fitter.add(trees)
  s1, joint_out, info = fitter.fit(s0, joint)
  assert joint_out is joint  # passed through untouched
  assert int(fitter.state_dict()["opt_state"][0].count) == 5
  s2, info2 = fitter.fit(s1)
  assert set(info2) >= {"predictor_fit_rows", "predictor_fit_leaf_weight_share"}
  saved = jax.tree.map(np.asarray, fitter.state_dict())
  other = PredictorFitter(g, tx, steps=5, bucket=64, pred_state=s0)
  other.load_state_dict(saved)
  other.add(trees)
  a, _ = fitter.fit(s2)
  b, _ = other.fit(s2)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)
  fresh = PredictorFitter(g, tx)
  with pytest.raises(ValueError, match="init"):
    fresh.state_dict()


def _noisy_trees(rs, n, start=0):
  """Trees with distinct prompts: root feature f, two leaves with success prob sigmoid(3 f[0])."""
  trees = []
  for i in range(n):
    f = rs.randn(8).astype(np.float32)
    t = Tree([start + i, 7])
    t.root.feature = f
    for _ in range(2):
      t.add_node(0, done=True, reward=float(rs.rand() < 1 / (1 + np.exp(-3 * f[0]))))
    trees.append(t)
  return trees


def test_holdout_keeps_the_best_held_out_step_and_the_same_prompts_out():
  from trace_jax.allocation.predictor_fit import held_out
  from trace_jax.rl.losses import predictor_bce

  rs = np.random.RandomState(1)
  head = PredictorHead(8, 64, rngs=nnx.Rngs(0))
  g, s0 = nnx.split(head)
  tx = make_optimizers(UpdateConfig(predictor_lr=3e-2))[1]
  fitter = PredictorFitter(g, tx, steps=300, buffer_steps=1, bucket=64, holdout=0.3,
                           pred_state=s0)
  trees = _noisy_trees(rs, 60)
  fitter.add(trees)
  s, info = fitter.fit(s0)
  held = [t for t in trees if held_out(t.prompt_ids, 0.3)]
  assert info["predictor_fit_holdout_rows"] == len(held) and 0 < len(held) < len(trees)
  assert info["predictor_fit_rows"] == len(trees) - len(held)
  # 60 noisy prompts and 300 steps at a high rate overfit: the held-out loss turns up before the
  # end, and the fit returns the best step's parameters, whose held-out loss is the one reported.
  assert 0 < info["predictor_fit_best_step"] < 300
  assert info["predictor_fit_holdout_bce_best"] < info["predictor_fit_holdout_bce_start"]
  hx = np.stack([t.root.feature for t in held])
  hy = np.asarray([t.root.value for t in held], np.float32)
  got = float(predictor_bce(nnx.merge(g, s)(hx), hy, np.full(len(held), 2.0, np.float32)))
  assert abs(got - info["predictor_fit_holdout_bce_best"]) < 1e-4
  assert held_out(trees[0].prompt_ids, 0.3) == held_out(list(trees[0].prompt_ids), 0.3)
  assert not held_out(trees[0].prompt_ids, 0.0)


def test_ensemble_members_disagree_where_data_is_thin_and_round_trip():
  rs = np.random.RandomState(2)
  head = PredictorHead(8, 32, rngs=nnx.Rngs(0))
  g, s0 = nnx.split(head)
  tx = make_optimizers(UpdateConfig(predictor_lr=1e-2))[1]
  fitter = PredictorFitter(g, tx, steps=150, buffer_steps=1, bucket=64, ensemble=4,
                           pred_state=s0)
  fitter.add(_noisy_trees(rs, 80))
  s, info = fitter.fit(s0)
  assert info["predictor_fit_members"] == 4
  near = rs.randn(50, 8).astype(np.float32)  # like the training features
  far = near * 6.0  # far outside them: the heads extrapolate apart
  mean, var = fitter.spread(s, np.concatenate([near, far]))
  assert mean.shape == (100,) and ((mean >= 0) & (mean <= 1)).all()
  assert (var >= 0).all() and var[:50].mean() > 0 and var[50:].mean() > var[:50].mean()
  d = fitter.state_dict()
  other = PredictorFitter(g, tx, ensemble=4, pred_state=s0)
  other.load_state_dict(d)
  np.testing.assert_allclose(other.spread(s, near)[1], fitter.spread(s, near)[1], rtol=1e-6)
  single = PredictorFitter(g, tx, pred_state=s0)
  m1, v1 = single.spread(s, near)
  np.testing.assert_allclose(m1, np.asarray(nnx.merge(g, s).prob(near)), rtol=1e-5, atol=1e-6)
  assert not v1.any()
