"""The success predictor's loss: weighted binary cross-entropy against soft targets.

Here, with the predictor's fit (`predictor_fit`) and metrics (`predictor_metrics`), so that
allocation needs nothing from rl; the joint update (`rl.update`) imports it through `rl.losses`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def predictor_bce(logits, targets, weights=None):
  """Weighted binary cross-entropy of the success predictor against soft targets V(y) in [0, 1].

  Uses softplus(x) - t x, the stable form of -t log sigmoid(x) - (1 - t) log(1 - sigmoid(x)).

  Args:
    logits: f32[N] predictor logits.
    targets: f32[N] soft targets in [0, 1].
    weights: optional f32[N] (e.g. leaf counts n_y, 0 on padding); None weighs all equally.

  Returns:
    f32[] weighted mean loss (0 when all weights are 0).
  """
  logits = jnp.asarray(logits, jnp.float32)
  targets = jnp.asarray(targets, jnp.float32)
  per = jax.nn.softplus(logits) - targets * logits
  w = jnp.ones_like(per) if weights is None else jnp.asarray(weights, jnp.float32)
  return jnp.sum(w * per) / jnp.maximum(jnp.sum(w), 1e-12)
