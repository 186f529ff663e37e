"""Success predictor head: norm + MLP -> logit on the policy's final hidden state at a prefix end.

The head reads the policy's hidden state with a stop-gradient, so its loss never moves the backbone
and, at sampling time, its input is a by-product of the forward pass the sampler already runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class PredictorHead(nnx.Module):
  """p̂(H) = sigmoid(MLP(RMSNorm(stop_grad(h_H)))). `__call__` returns logits f32[...].

  `head(features [..., D])` gives logits f32[...], `head.prob(features)` p̂ f32[...]; for jit,
  `predict_probs(graphdef, state, features)` is the same as a pure function.

  Example:
    >>> head = PredictorHead(d_model=64, hidden=32, rngs=nnx.Rngs(0))
    >>> head(jnp.ones((5, 64))).shape, head.prob(jnp.zeros((2, 3, 64))).shape
    ((5,), (2, 3))
  """

  def __init__(self, d_model: int, hidden: int = 128, *, rngs: nnx.Rngs, eps: float = 1e-6):
    self.scale = nnx.Param(jnp.ones((d_model,), jnp.float32), logical_axes=("norm",))
    self.w1 = nnx.Param(jax.random.normal(rngs.params(), (d_model, hidden)) * d_model ** -0.5,
                        logical_axes=("embed", "predictor_hidden"))
    self.b1 = nnx.Param(jnp.zeros((hidden,)), logical_axes=("predictor_hidden",))
    self.w2 = nnx.Param(jax.random.normal(rngs.params(), (hidden, 1)) * hidden ** -0.5 * 0.1,
                        logical_axes=("predictor_hidden", None))
    self.b2 = nnx.Param(jnp.zeros((1,)), logical_axes=(None,))
    self.eps = eps

  def __call__(self, features):
    """features: [..., D] hidden states -> logits f32[...]."""
    x = jax.lax.stop_gradient(features).astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps) * self.scale[...]
    h = jax.nn.gelu(x @ self.w1[...] + self.b1[...])
    return (h @ self.w2[...] + self.b2[...])[..., 0]

  def prob(self, features):
    return jax.nn.sigmoid(self(features))


PREDICTOR_FEATURES = ("last", "last+prompt_mean")


def feature_width(hidden_size: int, predictor_features: str = "last") -> int:
  """The head's input width for `model.predictor_features`: the final state at the prefix's last
  token (`last`), or that and the mean final state over the prompt, concatenated."""
  if predictor_features not in PREDICTOR_FEATURES:
    raise ValueError(f"model.predictor_features={predictor_features!r} must be one of "
                     f"{PREDICTOR_FEATURES}")
  return hidden_size * (2 if predictor_features == "last+prompt_mean" else 1)


def predict_probs(graphdef, state, features) -> jax.Array:
  """Pure function for jit: p̂ f32[N] from features [N, D]."""
  return nnx.merge(graphdef, state).prob(features)
