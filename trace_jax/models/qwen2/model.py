"""Qwen2 / Qwen2.5 decoder: the shared `models.decoder` with biases on the q/k/v projections and
no q/k norms (its `Qwen2Config`). The padding, segment and cache contract is `models.decoder`'s."""

from __future__ import annotations

from trace_jax.models.decoder import Decoder


class Qwen2(Decoder):
  """Qwen2 / Qwen2.5 causal LM (`models.decoder.Decoder` on a `Qwen2Config`): the same calls as
  every family (`__call__`, `forward`, `run_layers`, `logits`, `init_cache`).

  Example:
    >>> from trace_jax.models.qwen2 import get_preset
    >>> cfg = get_preset("qwen2p5_0p5b", vocab_size=64, hidden_size=32, intermediate_size=64,
    ...                  num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8)
    >>> Qwen2(cfg, rngs=nnx.Rngs(0))(jnp.zeros((2, 5), jnp.int32)).shape
    (2, 5, 64)
  """


__all__ = ["Qwen2"]
