"""Qwen3 decoder: the shared `models.decoder` with q/k norms (its config's default) and no
attention biases. The padding, segment and cache contract is `models.decoder`'s.

The building blocks stay importable from here for callers written before the decoder was shared.
"""

from __future__ import annotations

from trace_jax.models.attention import dense_attention
from trace_jax.models.decoder import (MLP, REMAT_POLICIES, AttendFn, Attention, Decoder,
                                      DecoderLayer, RMSNorm, cache_logical_axes, init_cache)


class Qwen3(Decoder):
  """Qwen3 causal LM (`models.decoder.Decoder` on a `Qwen3Config`).

  `model(tokens i32[B, T])` returns logits f32[B, T, V]; with `cache=` (a pytree from
  `init_cache`, {"layers": [{"k", "v": [B, S, Hkv, hd]}] * L, "lens": i32[B]}) it returns
  (logits, new_cache), writing the new tokens at `lens` and advancing it. `forward` also returns
  the final hidden states [B, T, D] (the predictor's features). Used functionally:
  `graphdef, state = nnx.split(model)`, then `nnx.merge(graphdef, state)` inside a jitted function.

  Example:
    >>> model = Qwen3(get_preset("tiny", vocab_size=64, num_layers=1), rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 5), jnp.int32)).shape
    (2, 5, 64)
    >>> logits, cache = model(jnp.zeros((2, 5), jnp.int32), cache=init_cache(model.cfg, 2, 16))
    >>> cache["lens"].tolist()  # the next tokens go to position 5
    [5, 5]
  """


__all__ = ["MLP", "REMAT_POLICIES", "AttendFn", "Attention", "Decoder", "DecoderLayer", "Qwen3",
           "RMSNorm", "cache_logical_axes", "dense_attention", "init_cache"]
