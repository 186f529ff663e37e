"""Qwen3 model configuration, named presets and conversion to/from HF `config.json`."""

from __future__ import annotations

import dataclasses

# resolve_dtype is imported from here by callers older than the shared decoder config.
from trace_jax.models.decoder_config import DecoderConfig, resolve_dtype  # noqa: F401


@dataclasses.dataclass(frozen=True)
class Qwen3Config(DecoderConfig):
  """Hyper-parameters of a Qwen3 decoder: the shared `DecoderConfig` with q/k norms on and
  Qwen3's HF defaults; `from_hf_dict` / `to_hf_dict` read and write a `qwen3` `config.json`;
  named presets come from `get_preset`.

  Example:
    >>> cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
    ...                   num_heads=4, num_kv_heads=2, head_dim=8)
    >>> cfg.gqa_group, cfg.replace(dtype="bfloat16").dtype == jnp.bfloat16
    (2, True)
  """

  MODEL_TYPE = "qwen3"
  ARCHITECTURE = "Qwen3ForCausalLM"
  DEFAULT_ROPE_THETA = 1_000_000.0
  DEFAULT_MAX_POSITIONS = 40960


def _preset(**kw) -> Qwen3Config:
  return Qwen3Config(vocab_size=151936, max_position_embeddings=40960, **kw)


PRESETS: dict[str, Qwen3Config] = {
    # The embedded default: a few million parameters, trained on the synthetic world on a CPU.
    # vocab_size is overwritten by the world's tokenizer.
    "tiny": Qwen3Config(vocab_size=2048, hidden_size=128, intermediate_size=384, num_layers=3,
                        num_heads=4, num_kv_heads=2, head_dim=32, tie_word_embeddings=True,
                        max_position_embeddings=1024, rope_theta=10_000.0),
    "qwen3_0p6b": _preset(hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                          num_kv_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3_1p7b": _preset(hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16,
                          num_kv_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3_4b": _preset(hidden_size=2560, intermediate_size=9728, num_layers=36, num_heads=32,
                        num_kv_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3_8b": _preset(hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
                        num_kv_heads=8, head_dim=128, tie_word_embeddings=False),
    "qwen3_14b": _preset(hidden_size=5120, intermediate_size=17408, num_layers=40, num_heads=40,
                         num_kv_heads=8, head_dim=128, tie_word_embeddings=False),
}


def get_preset(name: str, **overrides) -> Qwen3Config:
  """A named `Qwen3Config` (keys of PRESETS: tiny, qwen3_0p6b ... qwen3_14b) with field overrides.

  Example:
    >>> cfg = get_preset("tiny", vocab_size=512, num_layers=2)
    >>> cfg.vocab_size, cfg.num_layers, cfg.hidden_size
    (512, 2, 128)
  """
  if name not in PRESETS:
    raise KeyError(f"unknown Qwen3 preset {name!r}; known: {sorted(PRESETS)}")
  return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
