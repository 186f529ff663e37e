import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trace_jax.models.predictor import PredictorHead
from trace_jax.models.qwen3 import Qwen3, get_preset
from trace_jax.rl.update import UpdateConfig, init_train_state, jit_update_step, make_grad_fn

B, T, K = 4, 16, 3


def _setup(cfg, seed=0):
  model = Qwen3(get_preset("tiny", vocab_size=40, num_layers=1), rngs=nnx.Rngs(seed))
  head = PredictorHead(model.cfg.hidden_size, 16, rngs=nnx.Rngs(seed + 1))
  g, p = nnx.split(model)
  hg, hp = nnx.split(head)
  return g, hg, init_train_state(p, hp, cfg)


def _batch(seed=0):
  rs = np.random.RandomState(seed)
  tokens = rs.randint(0, 40, (B, T)).astype(np.int32)
  mask = (rs.rand(B, T) < 0.6).astype(np.float32)
  mask[:, 0] = 0
  return {
      "tokens": tokens, "segment_ids": np.ones((B, T), np.int32),
      "positions": np.tile(np.arange(T, dtype=np.int32), (B, 1)),
      "mask": mask, "adv": rs.randn(B, T).astype(np.float32),
      "old_logp": np.full((B, T), -3.7, np.float32), "ref_logp": np.zeros((B, T), np.float32),
      "pred_pos": rs.randint(0, T, (B, K)).astype(np.int32),
      "pred_target": rs.rand(B, K).astype(np.float32),
      "pred_weight": np.ones((B, K), np.float32)}


def _copy(tree):
  return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def test_micro_batching_equals_full_batch():
  c1, c2 = UpdateConfig(lr=1e-3, micro_batches=1), UpdateConfig(lr=1e-3, micro_batches=2)
  g, hg, s = _setup(c1)
  la, ma, ga = jax.jit(make_grad_fn(g, hg, c1))(s, _batch())
  lb, mb, gb = jax.jit(make_grad_fn(g, hg, c2))(s, _batch())
  for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6, rtol=1e-4)
  np.testing.assert_allclose(float(la), float(lb), rtol=1e-5)
  np.testing.assert_allclose(float(ma["predictor_bce"]), float(mb["predictor_bce"]), rtol=1e-4)


def test_update_changes_params_and_predictor_learns():
  cfg = UpdateConfig(lr=1e-3, predictor_lr=1e-2)
  g, hg, s = _setup(cfg)
  before = _copy(s["params"])
  step = jit_update_step(g, hg, cfg)
  batch = _batch()
  bces = []
  for _ in range(15):
    s, m = step(s, batch)
    bces.append(float(m["predictor_bce"]))
  assert int(s["step"]) == 15 and int(s["skipped"]) == 0
  assert bces[-1] < bces[0] - 0.02
  moved = max(float(jnp.abs(x - y).max())
              for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(s["params"])))
  assert moved > 1e-4


def test_non_finite_step_is_skipped_and_counted():
  cfg = UpdateConfig(lr=1e-3)
  g, hg, s = _setup(cfg)
  before = _copy(s)
  batch = _batch()
  batch["adv"][0, 3:] = np.nan
  s, m = jit_update_step(g, hg, cfg)(s, batch)
  assert int(s["skipped"]) == 1 and float(m["finite"]) == 0.0
  for x, y in zip(jax.tree.leaves(before["params"]), jax.tree.leaves(s["params"])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_empty_mask_gives_zero_policy_loss_and_finite_state():
  cfg = UpdateConfig(lr=1e-3)
  g, hg, s = _setup(cfg)
  batch = _batch()
  batch["mask"][:] = 0
  batch["pred_weight"][:] = 0
  s, m = jit_update_step(g, hg, cfg)(s, batch)
  assert float(m["pg_loss"]) == 0.0 and float(m["finite"]) == 1.0
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(s["params"]))


def test_indivisible_micro_batches_is_a_clear_error():
  cfg = UpdateConfig(micro_batches=3)
  g, hg, s = _setup(cfg)
  with pytest.raises(ValueError, match="micro_batches"):
    jit_update_step(g, hg, cfg)(s, _batch())
