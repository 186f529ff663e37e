"""Tests for the PPO-clip loss, token log-probs/entropy and the predictor BCE."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from trace_jax.rl import losses

_SETTINGS = settings(deadline=None, max_examples=25, derandomize=True)


def _batch(seed, shape=(3, 5)):
  rng = np.random.default_rng(seed)
  logp = jnp.asarray(-rng.random(shape) * 3, jnp.float32)
  adv = jnp.asarray(rng.normal(size=shape), jnp.float32)
  mask = jnp.asarray(rng.random(shape) < 0.7, jnp.float32)
  return logp, adv, mask


_grad = jax.jit(jax.grad(lambda new, old, a, m: losses.ppo_clip_loss(new, old, a, m)[0]))


@_SETTINGS
@given(seed=st.integers(0, 2**31 - 1))
def test_gradient_on_policy_is_minus_advantage_over_token_count(seed):
  logp, adv, mask = _batch(seed)
  g = np.asarray(_grad(logp, logp, adv, mask))
  expected = -np.asarray(adv * mask) / max(float(mask.sum()), 1.0)
  np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-7)


def test_clipping_stops_gradient_on_the_correct_side():
  old = jnp.zeros((1, 4))
  # Ratios e^0.5 ~ 1.65 (above 1.28) and e^-0.5 ~ 0.61 (below 0.8), once with each advantage sign.
  new = jnp.array([[0.5, -0.5, 0.5, -0.5]])
  adv = jnp.array([[1.0, 1.0, -1.0, -1.0]])
  mask = jnp.ones((1, 4))
  g = np.asarray(_grad(new, old, adv, mask))[0]
  r = np.exp([0.5, -0.5, 0.5, -0.5])
  # A > 0 and ratio too high: clipped, no push further up. A > 0 and ratio low: still pushed up.
  # A < 0 and ratio too low: clipped. A < 0 and ratio high: still pushed down.
  np.testing.assert_allclose(g, [0.0, -r[1] / 4, r[2] / 4, 0.0], rtol=1e-6)
  _, m = losses.ppo_clip_loss(new, old, adv, mask)
  np.testing.assert_allclose([m["clip_frac_high"], m["clip_frac_low"], m["clip_frac"]],
                             [0.25, 0.25, 0.5])


def test_asymmetric_clip_range():
  old = jnp.zeros((1, 2))
  new = jnp.log(jnp.array([[1.25, 0.82]]))  # Inside [0.8, 1.28]: not clipped for either sign.
  for sign in (1.0, -1.0):
    g = np.asarray(_grad(new, old, sign * jnp.ones((1, 2)), jnp.ones((1, 2))))
    np.testing.assert_allclose(g, -sign * np.array([[1.25, 0.82]]) / 2, rtol=1e-5)
  new = jnp.log(jnp.array([[1.3, 0.78]]))  # Just outside on both sides.
  g = np.asarray(_grad(new, old, jnp.array([[1.0, -1.0]]), jnp.ones((1, 2))))
  np.testing.assert_allclose(g, 0.0)


def test_loss_value_kl_entropy_and_metrics():
  logp, adv, mask = _batch(0)
  new = logp + 0.1
  ref = logp - 0.2
  ent = jnp.full(logp.shape, 2.0)
  loss, m = losses.ppo_clip_loss(new, logp, adv, mask, ref_logp=ref, kl_coef=0.5, entropy=ent,
                                 entropy_coef=0.01)
  n = float(mask.sum())
  ratio = np.exp(0.1)
  a = np.asarray(adv)
  pg = np.maximum(-a * ratio, -a * np.clip(ratio, 0.8, 1.28))
  np.testing.assert_allclose(m["pg_loss"], np.sum(pg * mask) / n, rtol=1e-5)
  d = -0.3
  np.testing.assert_allclose(m["kl_ref"], np.expm1(d) - d, rtol=1e-4)
  np.testing.assert_allclose(m["approx_kl"], np.expm1(0.1) - 0.1, rtol=1e-4)
  np.testing.assert_allclose(m["entropy"], 2.0, rtol=1e-6)
  np.testing.assert_allclose(loss, m["pg_loss"] + 0.5 * m["kl_ref"] - 0.01 * 2.0, rtol=1e-5)
  assert float(m["num_tokens"]) == n
  # The KL gradient pulls toward the reference: d k3 / d new = 1 - exp(ref - new) > 0 if new > ref.
  g = jax.grad(lambda x: losses.ppo_clip_loss(x, x, jnp.zeros_like(x), mask, ref_logp=ref,
                                              kl_coef=1.0)[0])(new)
  np.testing.assert_allclose(g, (1 - np.exp(-0.3)) * mask / n, rtol=1e-4, atol=1e-7)


def test_empty_mask_is_zero_and_finite():
  logp, adv, _ = _batch(1)
  mask = jnp.zeros_like(logp)
  loss, m = losses.ppo_clip_loss(logp + 1.0, logp, adv, mask)
  assert float(loss) == 0.0 and all(np.isfinite(float(v)) for v in m.values())
  assert np.all(np.isfinite(np.asarray(_grad(logp, logp, adv, mask))))


def test_normalizer_makes_microbatches_add_up():
  logp, adv, mask = _batch(2, shape=(4, 6))
  new = logp + 0.05
  full = jax.grad(lambda x: losses.ppo_clip_loss(x, logp, adv, mask)[0])(new)
  n = mask.sum()
  parts = [jax.grad(lambda x, s=s: losses.ppo_clip_loss(x, logp[s], adv[s], mask[s],
                                                        normalizer=n)[0])(new[s])
           for s in (slice(0, 2), slice(2, 4))]
  np.testing.assert_allclose(np.concatenate(parts), full, rtol=1e-5, atol=1e-8)


def test_token_logprobs_and_entropy():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 3, 7)).astype(np.float32)
  targets = rng.integers(0, 7, (2, 3))
  for temp in (1.0, 0.7):
    logp, ent = losses.token_logprobs_and_entropy(jnp.asarray(logits, jnp.bfloat16), targets,
                                                  temperature=temp)
    assert logp.dtype == jnp.float32 and ent.dtype == jnp.float32
    z = logits / temp
    ref_all = z - np.log(np.sum(np.exp(z - z.max(-1, keepdims=True)), -1, keepdims=True)) - z.max(
        -1, keepdims=True)
    ref = np.take_along_axis(ref_all, targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(logp, ref, atol=0.05)  # The bf16 round trip is the tolerance.
  logp, ent = losses.token_logprobs_and_entropy(logits, targets)
  ref_all = logits - np.log(np.sum(np.exp(logits), -1, keepdims=True))
  np.testing.assert_allclose(logp, np.take_along_axis(ref_all, targets[..., None], -1)[..., 0],
                             rtol=1e-5)
  np.testing.assert_allclose(ent, -np.sum(np.exp(ref_all) * ref_all, -1), rtol=1e-5)
  _, ent = losses.token_logprobs_and_entropy(jnp.zeros((1, 1, 8)), jnp.zeros((1, 1), jnp.int32))
  np.testing.assert_allclose(ent, np.log(8.0), rtol=1e-6)
  # A masked vocabulary (-inf logits) keeps entropy and its gradient finite.
  masked = jnp.array([[[0.0, 0.0, -jnp.inf, -jnp.inf]]])
  tgt = jnp.zeros((1, 1), jnp.int32)
  logp, ent = losses.token_logprobs_and_entropy(masked, tgt)
  np.testing.assert_allclose([logp[0, 0], ent[0, 0]], [-np.log(2.0), np.log(2.0)], rtol=1e-6)
  g = jax.grad(lambda x: jnp.sum(sum(losses.token_logprobs_and_entropy(x, tgt))))(masked)
  assert np.all(np.isfinite(np.asarray(g)))


def test_predictor_bce():
  logits = jnp.array([0.0, 2.0, -3.0, 80.0])
  targets = jnp.array([0.5, 1.0, 0.25, 0.0])
  s = 1 / (1 + np.exp(-np.asarray(logits[:3], np.float64)))
  t = np.asarray(targets[:3])
  per = -(t * np.log(s) + (1 - t) * np.log(1 - s))
  np.testing.assert_allclose(losses.predictor_bce(logits[:3], targets[:3]), per.mean(), rtol=1e-5)
  w = jnp.array([1.0, 3.0, 0.0])
  np.testing.assert_allclose(losses.predictor_bce(logits[:3], targets[:3], w),
                             (per[0] + 3 * per[1]) / 4, rtol=1e-5)
  np.testing.assert_allclose(losses.predictor_bce(logits[3:], targets[3:]), 80.0, rtol=1e-6)
  assert float(losses.predictor_bce(logits, targets, jnp.zeros(4))) == 0.0
  g = jax.grad(losses.predictor_bce)(logits[:3], targets[:3])
  np.testing.assert_allclose(g, (s - t) / 3, rtol=1e-5)
