"""Policy and predictor losses: token-level PPO-clip with clip-higher, KL and entropy terms, BCE.

All reductions are token means over the whole batch: sum over masked tokens divided by the number of
masked tokens, so a long trajectory weighs more than a short one per sequence but every token weighs
the same (the DAPO choice; a per-sequence mean would let short answers dominate).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The predictor's BCE is allocation's (`allocation.predictor_loss`); re-exported for the update.
from trace_jax.allocation.predictor_loss import predictor_bce as predictor_bce


def _token_mean(x, mask, denom):
  return jnp.sum(x * mask) / denom


def ppo_clip_loss(logp_new, logp_old, advantages, mask, *, eps_low: float = 0.2,
                  eps_high: float = 0.28, ref_logp=None, kl_coef: float = 0.0, entropy=None,
                  entropy_coef: float = 0.0, normalizer=None):
  """Token-level PPO-clip loss with asymmetric clipping.

  Per token, with ratio rho = exp(logp_new - logp_old):
    pg = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high)).
  A larger eps_high than eps_low (clip-higher) lets low-probability tokens with positive advantage
  grow further, which keeps entropy from collapsing. The KL to the reference uses the k3 estimator
  exp(ref - new) - (ref - new) - 1, which is non-negative and unbiased under samples from the
  policy. loss = mean(pg) + kl_coef mean(k3) - entropy_coef mean(entropy), token means over the
  batch.

  Args:
    logp_new: f32[B, T] log-probs of the sampled tokens under the current policy.
    logp_old: f32[B, T] log-probs under the sampling policy (no gradient flows into it).
    advantages: f32[B, T] per-token advantages.
    mask: f32[B, T] (or bool) 1 on trained tokens (generated and owned), 0 on prompt, observations,
      tokens owned by another sequence, and padding.
    eps_low, eps_high: clip range [1 - eps_low, 1 + eps_high].
    ref_logp: optional f32[B, T] reference-policy log-probs for the KL term.
    kl_coef: weight of the KL term (used only when ref_logp is given).
    entropy: optional f32[B, T] per-token entropies of the current policy.
    entropy_coef: weight of the entropy bonus (used only when entropy is given).
    normalizer: optional token count to divide by instead of this batch's sum(mask), e.g. the count
      over all micro-batches of a step so that accumulated gradients equal the full-batch gradient.

  Returns:
    (loss f32[], metrics dict of f32[]: pg_loss, clip_frac_low, clip_frac_high, clip_frac,
    approx_kl, kl_ref, entropy, num_tokens).

  Example:
    >>> logp_old = jnp.log(jnp.full((1, 4), 0.5))
    >>> logp_new = logp_old + jnp.array([[0.0, 0.1, 0.5, -0.5]])  # ratios 1, 1.11, 1.65, 0.61
    >>> loss, metrics = ppo_clip_loss(logp_new, logp_old, jnp.ones((1, 4)), jnp.ones((1, 4)))
    >>> round(float(loss), 3), float(metrics["clip_frac"])  # 1.65 is clipped to 1 + 0.28
    (-0.998, 0.25)
  """
  mask = jnp.asarray(mask, jnp.float32)
  logp_old = jax.lax.stop_gradient(logp_old)
  advantages = jax.lax.stop_gradient(advantages)
  num_tokens = jnp.sum(mask)
  total = num_tokens if normalizer is None else jnp.asarray(normalizer, jnp.float32)
  denom = jnp.maximum(total, 1.0)

  log_ratio = logp_new - logp_old
  ratio = jnp.exp(log_ratio)
  clipped_ratio = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
  pg = jnp.maximum(-advantages * ratio, -advantages * clipped_ratio)
  pg_loss = _token_mean(pg, mask, denom)
  loss = pg_loss

  # A token is clipped when the clipped branch is the active one and its gradient is zero.
  clip_high = (advantages > 0) & (ratio > 1.0 + eps_high)
  clip_low = (advantages < 0) & (ratio < 1.0 - eps_low)
  metrics = {
      "pg_loss": pg_loss,
      "clip_frac_high": _token_mean(clip_high, mask, denom),
      "clip_frac_low": _token_mean(clip_low, mask, denom),
      "clip_frac": _token_mean(clip_high | clip_low, mask, denom),
      # k3 with r = new / old: estimates KL(old || new) from the old policy's samples.
      "approx_kl": _token_mean(jax.lax.stop_gradient(jnp.expm1(log_ratio) - log_ratio), mask,
                               denom),
      "num_tokens": num_tokens,
  }
  if ref_logp is not None:
    d = jax.lax.stop_gradient(ref_logp) - logp_new
    kl_ref = _token_mean(jnp.expm1(d) - d, mask, denom)
    loss = loss + kl_coef * kl_ref
    metrics["kl_ref"] = kl_ref
  else:
    metrics["kl_ref"] = jnp.zeros((), jnp.float32)
  if entropy is not None:
    ent = _token_mean(entropy, mask, denom)
    loss = loss - entropy_coef * ent
    metrics["entropy"] = ent
  else:
    metrics["entropy"] = jnp.zeros((), jnp.float32)
  return loss, metrics


def token_logprobs_and_entropy(logits, targets, temperature: float = 1.0):
  """Log-prob of each target token and the entropy of each next-token distribution.

  Computed in float32 whatever the logits dtype, since bf16 log-softmax loses the small ratio
  differences PPO depends on. Pass the sampling temperature so log-probs match the sampler's.

  Args:
    logits: f32[B, T, V] (or bf16) logits predicting targets[:, t] at position t.
    targets: i32[B, T] token ids.
    temperature: softmax temperature (> 0).

  Returns:
    (logp f32[B, T], entropy f32[B, T]).

  Example:
    >>> logits = jnp.log(jnp.array([[[0.5, 0.25, 0.25]]]))  # B = 1, T = 1, V = 3
    >>> logp, entropy = token_logprobs_and_entropy(logits, jnp.array([[0]]))
    >>> round(float(jnp.exp(logp[0, 0])), 3), round(float(entropy[0, 0]), 3)
    (0.5, 1.04)
  """
  logits = jnp.asarray(logits, jnp.float32) / temperature
  logp_all = jax.nn.log_softmax(logits, axis=-1)
  logp = jnp.take_along_axis(logp_all, jnp.asarray(targets, jnp.int32)[..., None], axis=-1)[..., 0]
  probs = jnp.exp(logp_all)
  # Masked vocabulary entries (logit -inf) would give 0 * -inf = nan.
  entropy = -jnp.sum(probs * jnp.where(probs > 0, logp_all, 0.0), axis=-1)
  return logp, entropy


def token_logprobs(logits, targets, temperature: float = 1.0):
  """Log-prob of each target token only (no entropy), in float32: f32[B, T, V] -> f32[B, T]."""
  logits = jnp.asarray(logits, jnp.float32) / temperature
  logp_all = jax.nn.log_softmax(logits, axis=-1)
  return jnp.take_along_axis(logp_all, jnp.asarray(targets, jnp.int32)[..., None], axis=-1)[..., 0]
