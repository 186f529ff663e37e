"""Llama 3.x decoder: the shared `models.decoder` with no biases, no q/k norms and `llama3`
rope scaling (its `LlamaConfig`). The padding, segment and cache contract is `models.decoder`'s."""

from __future__ import annotations

from trace_jax.models.decoder import Decoder


class Llama(Decoder):
  """Llama 3.x causal LM (`models.decoder.Decoder` on a `LlamaConfig`): the same calls as every
  family (`__call__`, `forward`, `run_layers`, `logits`, `init_cache`).

  Example:
    >>> from trace_jax.models.llama import get_preset
    >>> cfg = get_preset("llama3p2_1b", vocab_size=64, hidden_size=32, intermediate_size=64,
    ...                  num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8)
    >>> Llama(cfg, rngs=nnx.Rngs(0))(jnp.zeros((2, 5), jnp.int32)).shape
    (2, 5, 64)
  """


__all__ = ["Llama"]
