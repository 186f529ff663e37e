import contextlib
import dataclasses
import functools
import io
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from trace_jax.models.predictor import PredictorHead
from trace_jax.models.qwen3 import Qwen3, get_preset
from trace_jax.rl.update import (UpdateConfig, init_train_state, jit_update_step, make_grad_fn,
                                 policy_params, reference_logprobs)

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


@functools.cache
def _step(cfg):
  """One compiled update per config, shared by the tests (graphs of `_setup` are all equal)."""
  g, hg, _ = _setup(cfg)
  return jit_update_step(g, hg, cfg)


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
  _, _, s = _setup(cfg)
  before = _copy(s)
  batch = _batch()
  batch["adv"][0, 3:] = np.nan
  s, m = _step(cfg)(s, batch)
  assert int(s["skipped"]) == 1 and float(m["finite"]) == 0.0
  for x, y in zip(jax.tree.leaves(before["params"]), jax.tree.leaves(s["params"])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_empty_mask_gives_zero_policy_loss_and_finite_state():
  cfg = UpdateConfig(lr=1e-3)
  _, _, s = _setup(cfg)
  batch = _batch()
  batch["mask"][:] = 0
  batch["pred_weight"][:] = 0
  s, m = _step(cfg)(s, batch)
  assert float(m["pg_loss"]) == 0.0 and float(m["finite"]) == 1.0
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(s["params"]))


def test_indivisible_micro_batches_is_a_clear_error():
  cfg = UpdateConfig(micro_batches=3)
  g, hg, s = _setup(cfg)
  with pytest.raises(ValueError, match="micro_batches"):
    jit_update_step(g, hg, cfg)(s, _batch())


# ---- remat, f32 masters, divergence guard, reference log-probs -----------------------------------
def test_remat_policies_give_the_same_gradients():
  base = UpdateConfig(micro_batches=2)
  g, hg, s = _setup(base)
  batch = _batch(1)
  res = {}
  for remat in ("none", "full", "dots"):
    cfg = dataclasses.replace(base, remat=remat)
    res[remat] = jax.jit(make_grad_fn(g, hg, cfg))(s, batch)
  for remat in ("full", "dots"):
    np.testing.assert_allclose(float(res[remat][0]), float(res["none"][0]), rtol=1e-6)
    for x, y in zip(jax.tree.leaves(res["none"][2]), jax.tree.leaves(res[remat][2])):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-7, rtol=1e-5)
  with pytest.raises(ValueError, match="remat"):
    UpdateConfig(remat="some")


def test_remat_saves_only_what_its_policy_says():
  """What the backward pass keeps from the forward (JAX's own residual list, per policy)."""
  g, _, s = _setup(UpdateConfig())
  tokens = jnp.asarray(_batch()["tokens"])
  f = 384  # the tiny preset's MLP size

  def residual_shapes(remat):
    def loss(p):
      return nnx.merge(g, p).forward(tokens, remat=remat)["logits"].sum()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
      print_saved_residuals(loss, s["params"])
    return [tuple(int(n) for n in m.split(",") if n)
            for m in re.findall(r"^\w+\[([\d,]*)\]", buf.getvalue(), re.MULTILINE)]

  def n_scores(shapes):  # attention scores / probabilities [B, Hkv, G, T, T] or [B, Hkv, G*T, T]
    return sum(1 for sh in shapes if len(sh) >= 4 and sh[-1] == T and sh[-2] % T == 0)
  none, full, dots = (residual_shapes(r) for r in ("none", "full", "dots"))
  assert n_scores(none) > 0 and n_scores(full) == 0 and n_scores(dots) == 0
  assert (B, T, f) in none and (B, T, f) not in full  # MLP activations recomputed
  assert (B, T, f) in dots  # the gate/up matmul outputs are kept under "dots"
  assert len(full) < len(dots) < len(none)


def _bf16_setup(cfg, seed=0):
  model = Qwen3(get_preset("tiny", vocab_size=40, num_layers=1, param_dtype="bfloat16"),
                rngs=nnx.Rngs(seed))
  head = PredictorHead(model.cfg.hidden_size, 16, rngs=nnx.Rngs(seed + 1))
  g, p = nnx.split(model)
  hg, hp = nnx.split(head)
  return g, hg, p, init_train_state(p, hp, cfg)


def _moved_fraction(a, b):
  a, b = jax.tree.leaves(a), jax.tree.leaves(b)
  changed = sum(int(np.sum(np.asarray(x) != np.asarray(y))) for x, y in zip(a, b))
  return changed / sum(x.size for x in a)


def test_f32_master_moves_every_step_at_lr_1e6_with_bf16_params():
  cfg = UpdateConfig(lr=1e-6, param_dtype="bfloat16")
  g, hg, p, s = _bf16_setup(cfg)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(s["params"]))
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(s["opt"]) if x.ndim)  # f32 moments
  step = jit_update_step(g, hg, cfg)
  batch = _batch(2)
  batch["mask"][:, 1:] = 1.0  # every vocabulary row of the output layer gets a gradient
  for _ in range(3):
    before = _copy(s["params"])
    s, m = step(s, batch)
    assert float(m["skipped"]) == 0.0
    assert _moved_fraction(before, s["params"]) > 0.9
  pol = policy_params(s, "bfloat16")
  for x, y in zip(jax.tree.leaves(pol), jax.tree.leaves(s["params"])):
    assert x.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y.astype(jnp.bfloat16)))
  # Without masters, bf16 weights and moments barely move at this learning rate.
  raw = dataclasses.replace(cfg, master_dtype=None)
  g, hg, _, s2 = _bf16_setup(raw)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(s2["params"]))
  before = _copy(s2["params"])
  s2, _ = jit_update_step(g, hg, raw)(s2, batch)
  assert _moved_fraction(before, s2["params"]) < 0.1


def test_bf16_with_masters_learns_like_f32():
  batch = _batch(3)
  losses, deltas = {}, {}
  for name, dtype in (("f32", "float32"), ("bf16", "bfloat16")):
    cfg = UpdateConfig(lr=1e-4, param_dtype=dtype)
    model = Qwen3(get_preset("tiny", vocab_size=40, num_layers=1, param_dtype=dtype),
                  rngs=nnx.Rngs(0))
    head = PredictorHead(model.cfg.hidden_size, 16, rngs=nnx.Rngs(1))
    g, p = nnx.split(model)
    hg, hp = nnx.split(head)
    s = init_train_state(p, hp, cfg)
    start = _copy(s["params"])
    step = jit_update_step(g, hg, cfg)
    ls = []
    for _ in range(4):
      s, m = step(s, batch)
      ls.append(float(m["pg_loss"]))
    losses[name] = ls
    deltas[name] = np.concatenate([(np.asarray(a) - np.asarray(b)).ravel() for a, b in
                                   zip(jax.tree.leaves(s["params"]), jax.tree.leaves(start))])
  for name in losses:  # the policy loss falls over the steps in both
    assert losses[name][-1] < losses[name][0], losses
  cos = deltas["f32"] @ deltas["bf16"] / np.linalg.norm(deltas["f32"]) / np.linalg.norm(
      deltas["bf16"])
  assert cos > 0.8, cos


@pytest.mark.parametrize("lr", [float("nan"), 1e30])
def test_divergent_update_is_skipped_and_params_stay_finite(lr):
  cfg = UpdateConfig(lr=lr)
  g, hg, s = _setup(cfg)
  before = _copy(s)
  step = jit_update_step(g, hg, cfg)
  batch = _batch()
  for i in range(2):
    s, m = step(s, batch)
    assert float(m["skipped"]) == 1.0 and float(m["skip_streak"]) == i + 1
  # nan: the would-be parameters are not finite; 1e30: finite but far larger than the weights.
  assert float(m["finite"]) == (0.0 if math.isnan(lr) else 1.0)
  assert int(s["skipped"]) == 2 and int(s["skip_streak"]) == 2 and int(s["step"]) == 2
  for x, y in zip(jax.tree.leaves(before["params"]), jax.tree.leaves(s["params"])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  for x, y in zip(jax.tree.leaves(before["opt"]), jax.tree.leaves(s["opt"])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_skip_streak_resets_after_a_good_step():
  cfg = UpdateConfig(lr=1e-3)
  _, _, s = _setup(cfg)
  step = _step(cfg)
  bad = _batch()
  bad["adv"][0, 3:] = np.nan
  s, m = step(s, bad)
  s, m = step(s, bad)
  assert float(m["skip_streak"]) == 2.0
  s, m = step(s, _batch())
  assert float(m["skipped"]) == 0.0 and int(s["skip_streak"]) == 0 and int(s["skipped"]) == 2


def test_reference_logprobs_in_micro_batches_equal_one_pass():
  g, _, s = _setup(UpdateConfig())
  batch = _batch(4)
  one = reference_logprobs(g, s["params"], batch, micro_batches=1)
  two = reference_logprobs(g, s["params"], batch, micro_batches=2, temperature=1.0)
  assert isinstance(two, jax.Array) and two.shape == (B, T)
  np.testing.assert_allclose(np.asarray(one), np.asarray(two), atol=1e-6)
  model = nnx.merge(g, s["params"])
  logits = model(jnp.asarray(batch["tokens"]), positions=jnp.asarray(batch["positions"]),
                 segment_ids=jnp.asarray(batch["segment_ids"]))
  lp = jax.nn.log_softmax(logits[:, :-1], -1)
  want = np.take_along_axis(np.asarray(lp), batch["tokens"][:, 1:, None], -1)[..., 0]
  np.testing.assert_allclose(np.asarray(two)[:, 1:], want, atol=1e-5)
  assert np.all(np.asarray(two)[:, 0] == 0)
