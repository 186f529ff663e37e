"""Llama 3.x configuration (HF `model_type` "llama"), named presets, HF `config.json`."""

from __future__ import annotations

import dataclasses

from trace_jax.models.decoder_config import DecoderConfig


@dataclasses.dataclass(frozen=True)
class LlamaConfig(DecoderConfig):
  """Hyper-parameters of a Llama 3.x decoder: the shared `DecoderConfig` with no biases, no q/k
  norms, `llama3` rope scaling where configured, and Llama's HF defaults. HF's `attention_bias`
  and `mlp_bias` (biases on every projection, the output ones included; false in every released
  Llama 3) are refused on reading.

  Example:
    >>> cfg = get_preset("llama3p1_8b")
    >>> dict(cfg.rope_scaling)["rope_type"], cfg.gqa_group, cfg.tie_word_embeddings
    ('llama3', 4, False)
  """

  MODEL_TYPE = "llama"
  ARCHITECTURE = "LlamaForCausalLM"
  DEFAULT_ROPE_THETA = 10_000.0
  DEFAULT_MAX_POSITIONS = 2048

  rms_norm_eps: float = 1e-5
  rope_theta: float = 500_000.0
  max_position_embeddings: int = 131072
  qk_norm: bool = False

  def __post_init__(self):
    super().__post_init__()
    if self.attention_bias or self.qk_norm:
      raise ValueError("a Llama decoder has no attention biases and no q/k norms")

  @classmethod
  def hf_fields(cls, d: dict) -> dict:
    for key in ("attention_bias", "mlp_bias"):
      if d.get(key):
        raise ValueError(f"{key}=true is not supported (the decoder has no output-projection "
                         "or MLP biases)")
    return super().hf_fields(d)

  def to_hf_dict(self) -> dict:
    return super().to_hf_dict() | {"mlp_bias": False, "pretraining_tp": 1}


def _preset(factor: float, **kw) -> LlamaConfig:
  scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
  return LlamaConfig(vocab_size=128256, rope_theta=500_000.0, max_position_embeddings=131072,
                     rms_norm_eps=1e-5, rope_scaling=tuple(sorted(scaling.items())), **kw)


PRESETS: dict[str, LlamaConfig] = {
    "llama3p2_1b": _preset(32.0, hidden_size=2048, intermediate_size=8192, num_layers=16,
                           num_heads=32, num_kv_heads=8, head_dim=64, tie_word_embeddings=True),
    "llama3p2_3b": _preset(32.0, hidden_size=3072, intermediate_size=8192, num_layers=28,
                           num_heads=24, num_kv_heads=8, head_dim=128, tie_word_embeddings=True),
    "llama3p1_8b": _preset(8.0, hidden_size=4096, intermediate_size=14336, num_layers=32,
                           num_heads=32, num_kv_heads=8, head_dim=128, tie_word_embeddings=False),
}


def get_preset(name: str, **overrides) -> LlamaConfig:
  """A named `LlamaConfig` (keys of PRESETS: llama3p2_1b, llama3p2_3b, llama3p1_8b) with field
  overrides.

  Example:
    >>> get_preset("llama3p2_1b", num_layers=2).num_layers
    2
  """
  if name not in PRESETS:
    raise KeyError(f"unknown Llama preset {name!r}; known: {sorted(PRESETS)}")
  return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
