"""Qwen2 / Qwen2.5 configuration (HF `model_type` "qwen2"), named presets, HF `config.json`."""

from __future__ import annotations

import dataclasses

from trace_jax.models.decoder_config import DecoderConfig


@dataclasses.dataclass(frozen=True)
class Qwen2Config(DecoderConfig):
  """Hyper-parameters of a Qwen2 / Qwen2.5 decoder: the shared `DecoderConfig` with biases on the
  q/k/v projections, no q/k norms, and Qwen2's HF defaults. Sliding-window attention
  (`use_sliding_window`, off in every released Qwen2.5) is refused on reading.

  Example:
    >>> cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
    ...                   num_heads=4, num_kv_heads=2, head_dim=8)
    >>> cfg.attention_bias, cfg.qk_norm, cfg.to_hf_dict()["model_type"]
    (True, False, 'qwen2')
  """

  MODEL_TYPE = "qwen2"
  ARCHITECTURE = "Qwen2ForCausalLM"
  DEFAULT_ROPE_THETA = 10_000.0
  DEFAULT_MAX_POSITIONS = 32768

  attention_bias: bool = True
  qk_norm: bool = False
  max_position_embeddings: int = 32768

  def __post_init__(self):
    super().__post_init__()
    if not self.attention_bias or self.qk_norm:
      raise ValueError("a Qwen2 decoder has q/k/v biases and no q/k norms (attention_bias=True, "
                       "qk_norm=False)")

  @classmethod
  def hf_fields(cls, d: dict) -> dict:
    layer_types = d.get("layer_types") or ()
    sliding = "sliding_attention" in layer_types or (
        d.get("use_sliding_window") and d.get("max_window_layers", 28) < d.get(
            "num_hidden_layers", 0))
    if sliding:
      raise ValueError("sliding-window attention (use_sliding_window) is not supported")
    return super().hf_fields(d) | {"attention_bias": True}  # config.json does not say it

  def to_hf_dict(self) -> dict:
    d = super().to_hf_dict()
    del d["attention_bias"]
    return d | {"use_sliding_window": False, "sliding_window": None,
                "max_window_layers": self.num_layers}


def _preset(**kw) -> Qwen2Config:
  return Qwen2Config(vocab_size=151936, rope_theta=1_000_000.0, max_position_embeddings=32768,
                     rms_norm_eps=1e-6, **kw)


PRESETS: dict[str, Qwen2Config] = {
    "qwen2p5_0p5b": _preset(hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                            num_kv_heads=2, head_dim=64, tie_word_embeddings=True),
    "qwen2p5_1p5b": _preset(hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
                            num_kv_heads=2, head_dim=128, tie_word_embeddings=True),
    "qwen2p5_3b": _preset(hidden_size=2048, intermediate_size=11008, num_layers=36, num_heads=16,
                          num_kv_heads=2, head_dim=128, tie_word_embeddings=True),
    "qwen2p5_7b": _preset(hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
                          num_kv_heads=4, head_dim=128, tie_word_embeddings=False).replace(
                              vocab_size=152064),
}


def get_preset(name: str, **overrides) -> Qwen2Config:
  """A named `Qwen2Config` (keys of PRESETS: qwen2p5_0p5b ... qwen2p5_7b) with field overrides.

  Example:
    >>> get_preset("qwen2p5_7b").num_kv_heads
    4
  """
  if name not in PRESETS:
    raise KeyError(f"unknown Qwen2 preset {name!r}; known: {sorted(PRESETS)}")
  return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
