"""Success estimates the allocators read besides the head's raw p̂: a Beta-posterior blend with
outcomes already seen (`blend_with_outcomes`), an anchor's estimate from its tree's stage-1
outcomes (`anchor_posterior`), and the head's Platt recalibration (`platt_fit`, `platt_apply`).
"""

from __future__ import annotations

import jax
import numpy as np
import jax.numpy as jnp


def blend_with_outcomes(p_hat, successes, trials, prior_strength):
  """Beta-posterior mean of a prefix's success probability given outcomes already seen under it.

  Prior Beta(s p_hat, s (1 - p_hat)) with s = prior_strength, observations `successes` out of
  `trials` (fractional rewards count fractionally): posterior mean
  (s p_hat + successes) / (s + trials). With no trials this is p_hat; with s = 0 it is the
  empirical rate.

  Args:
    p_hat: f32[H]; successes: f32[H]; trials: f32[H]; prior_strength: scalar or f32[H], >= 0.

  Returns:
    f32[H] blended probabilities.
  """
  p_hat = jnp.asarray(p_hat, jnp.float32)
  s = jnp.asarray(prior_strength, jnp.float32)
  trials = jnp.asarray(trials, jnp.float32)
  denom = s + trials
  post = (s * p_hat + jnp.asarray(successes, jnp.float32)) / jnp.where(denom > 0, denom, 1.0)
  return jnp.where(denom > 0, post, p_hat)


def anchor_posterior(p_anchor, p_root, successes, trials, prior_strength):
  """Success estimate of an anchor from its tree's own stage-1 outcomes and the predictor.

  The tree's prompt success rate gets a Beta posterior: prior Beta(s p_root, s (1 - p_root)) with
  s = prior_strength, updated with the tree's stage-1 `successes` out of `trials`, posterior mean
  p_tree = (s p_root + successes) / (s + trials). What the predictor says about the anchor beyond
  its prompt, p_anchor against p_root, then shifts that mean in logit space:
    logit(p_h) = logit(p_tree) + logit(p_anchor) - logit(p_root),
  so the root itself gets p_tree, an anchor the head rates above its prompt stays above it, and
  the result stays in (0, 1). The leaves of the same tree speak about the prompt more directly than
  the head does; the head still ranks anchors within a tree. prior_strength = 0 trusts the counts
  alone (where trials > 0); with no trials the result is p_anchor.

  Args:
    p_anchor: f32[H] predictor estimate at each anchor.
    p_root: f32[H] predictor estimate at the anchor's tree root.
    successes, trials: f32[H] stage-1 successes and rollouts of the anchor's tree.
    prior_strength: scalar >= 0.

  Returns:
    f32[H] posterior success probabilities, clipped to [1e-4, 1 - 1e-4].
  """
  lo, hi = 1e-4, 1.0 - 1e-4
  p_anchor = jnp.clip(jnp.asarray(p_anchor, jnp.float32), lo, hi)
  p_root = jnp.clip(jnp.asarray(p_root, jnp.float32), lo, hi)
  p_tree = jnp.clip(blend_with_outcomes(p_root, successes, trials, prior_strength), lo, hi)
  logit = lambda p: jnp.log(p) - jnp.log1p(-p)  # noqa: E731
  return jnp.clip(jax.nn.sigmoid(logit(p_tree) + logit(p_anchor) - logit(p_root)), lo, hi)


def platt_fit(p_hat, outcomes, prior_strength: float = 10.0, steps: int = 25):
  """Platt calibration of a predictor from (p̂, outcome) pairs: (a, b) such that
  sigmoid(a * logit(p̂) + b) matches the outcomes, under a Gaussian prior centred on the identity
  (a = 1, b = 0) whose weight equals `prior_strength` pairs, so a few pairs barely move it.

  Args:
    p_hat: f32[N] predicted success probabilities in (0, 1).
    outcomes: f32[N] observed rewards in {0, 1} (or in [0, 1]).
    prior_strength: pseudo-pairs of evidence for the identity map.
    steps: Newton steps (the problem is convex: 2 parameters, logistic loss + quadratic prior).
  Returns:
    (a, b) floats.

  >>> y = np.array([1.0] * 30 + [0.0] * 20 + [1.0] * 10 + [0.0] * 40)  # p̂ 0.9 -> 60% succeed
  >>> a, b = platt_fit(np.array([0.9] * 50 + [0.1] * 50), y)
  >>> bool(platt_apply(np.array([0.9]), a, b)[0] < 0.75)  # overconfident p̂ is pulled in
  True
  """
  p = np.clip(np.asarray(p_hat, np.float64), 1e-4, 1 - 1e-4)
  y = np.asarray(outcomes, np.float64)
  if p.shape != y.shape or p.ndim != 1:
    raise ValueError(f"p_hat {p.shape} and outcomes {y.shape} must be equal 1-D shapes")
  x = np.stack([np.log(p / (1 - p)), np.ones_like(p)], axis=1)
  theta, prior = np.array([1.0, 0.0]), np.array([1.0, 0.0])
  lam = float(prior_strength)

  def loss(t):  # penalized negative log-likelihood (convex)
    z = x @ t
    return float(np.sum(np.logaddexp(0, z) - y * z) + 0.5 * lam * np.sum((t - prior) ** 2))

  cur = loss(theta)
  for _ in range(steps):
    q = 1 / (1 + np.exp(-(x @ theta)))
    grad = x.T @ (q - y) + lam * (theta - prior)
    hess = (x * (q * (1 - q))[:, None]).T @ x + (lam + 1e-9) * np.eye(2)
    step = np.linalg.solve(hess, grad)
    t = 1.0  # backtracking: a plain Newton step overshoots on saturated logits
    while t > 1e-6 and loss(theta - t * step) > cur - 1e-4 * t * float(grad @ step):
      t *= 0.5
    if t <= 1e-6:
      break
    theta = theta - t * step
    new = loss(theta)
    if cur - new < 1e-10:
      break
    cur = new
  return float(theta[0]), float(theta[1])


def platt_apply(p_hat, a: float, b: float):
  """sigmoid(a * logit(p̂) + b), elementwise (numpy)."""
  p = np.clip(np.asarray(p_hat, np.float64), 1e-4, 1 - 1e-4)
  return (1 / (1 + np.exp(-(a * np.log(p / (1 - p)) + b)))).astype(np.float32)
