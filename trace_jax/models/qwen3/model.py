"""Qwen3 decoder: the shared `models.decoder` with q/k norms (its config's default) and no
attention biases. The padding, segment and cache contract is `models.decoder`'s.

The building blocks stay importable from here for callers written before the decoder was shared.
"""

from __future__ import annotations

from trace_jax.models.attention import dense_attention
from trace_jax.models.decoder import (MLP, REMAT_POLICIES, AttendFn, Attention, Decoder,
                                      DecoderLayer, RMSNorm, cache_logical_axes, init_cache)


class Qwen3(Decoder):
  """Qwen3 causal LM: `models.decoder.Decoder` (its call, cache and `forward` contract) on a
  `Qwen3Config`.

  Example:
    >>> Qwen3(get_preset("tiny", vocab_size=64, num_layers=1), rngs=nnx.Rngs(0)).cfg.qk_norm
    True
  """


__all__ = ["MLP", "REMAT_POLICIES", "AttendFn", "Attention", "Decoder", "DecoderLayer", "Qwen3",
           "RMSNorm", "cache_logical_axes", "dense_attention", "init_cache"]
