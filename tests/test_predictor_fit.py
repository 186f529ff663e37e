import numpy as np
from flax import nnx

from trace_jax.models.predictor import PredictorHead
from trace_jax.rl.predictor_fit import PredictorFitter, node_examples
from trace_jax.rl.predictor_metrics import auc
from trace_jax.rl.update import UpdateConfig, make_optimizers
from trace_jax.rollout.tree import Tree


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
