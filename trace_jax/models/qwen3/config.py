"""Qwen3 model configuration, named presets and conversion to/from HF `config.json`."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def resolve_dtype(dtype) -> Any:
  """Accepts a jnp dtype or one of 'float32', 'bfloat16', 'float16'."""
  if isinstance(dtype, str):
    if dtype not in _DTYPES:
      raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]
  return dtype


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
  """Hyper-parameters of a Qwen3 decoder.

  `dtype` is the compute dtype, `param_dtype` the storage dtype of the weights. Norms, softmax and
  logits are always computed in float32. `from_hf_dict` / `to_hf_dict` read and write HF
  `config.json`; named presets come from `get_preset`.

  Example:
    >>> cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
    ...                   num_heads=4, num_kv_heads=2, head_dim=8)
    >>> cfg.gqa_group, cfg.replace(dtype="bfloat16").dtype == jnp.bfloat16
    (2, True)
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 1_000_000.0
  rope_scaling: tuple[tuple[str, Any], ...] | None = None  # HF rope parameters beyond theta
  tie_word_embeddings: bool = False
  attention_bias: bool = False
  max_position_embeddings: int = 40960
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim"):
      if int(getattr(self, name)) <= 0:
        raise ValueError(f"Qwen3Config.{name} must be positive, got {getattr(self, name)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                       f"num_kv_heads={self.num_kv_heads}")
    object.__setattr__(self, "dtype", resolve_dtype(self.dtype))
    object.__setattr__(self, "param_dtype", resolve_dtype(self.param_dtype))

  @property
  def gqa_group(self) -> int:
    return self.num_heads // self.num_kv_heads

  def replace(self, **kw) -> "Qwen3Config":
    return dataclasses.replace(self, **kw)

  # ---- HF config.json ----------------------------------------------------------------------------
  @classmethod
  def from_hf_dict(cls, d: dict, **overrides) -> "Qwen3Config":
    """Reads an HF Qwen3 `config.json` dict (transformers 4.x `rope_theta`/`rope_scaling` or 5.x
    `rope_parameters`)."""
    mt = d.get("model_type", "qwen3")
    if mt != "qwen3":
      raise ValueError(f"config.json model_type is {mt!r}; only 'qwen3' is supported")
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads")
    missing = [k for k in required if k not in d]
    if missing:
      raise KeyError(f"config.json lacks required keys {missing}")
    rope = dict(d.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", None) or d.get("rope_theta", 1_000_000.0)
    scaling = rope or d.get("rope_scaling") or None
    if scaling:
      scaling = dict(scaling)
      kind = scaling.get("rope_type", scaling.get("type", "default"))
      if kind == "default":
        scaling = None
      elif kind not in ("linear", "yarn", "dynamic", "llama3"):
        raise ValueError(f"unsupported rope scaling type {kind!r} in config.json")
    heads = d["num_attention_heads"]
    kw = dict(
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"],
        num_heads=heads, num_kv_heads=d.get("num_key_value_heads", heads),
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
        rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
        tie_word_embeddings=d.get("tie_word_embeddings", False),
        attention_bias=d.get("attention_bias", False),
        max_position_embeddings=d.get("max_position_embeddings", 40960))
    kw.update(overrides)
    return cls(**kw)

  def to_hf_dict(self) -> dict:
    rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
    if self.rope_scaling:
      rope_parameters = dict(self.rope_scaling) | {"rope_theta": self.rope_theta}
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps,
        "rope_theta": self.rope_theta,
        "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": self.attention_bias,
        "max_position_embeddings": self.max_position_embeddings, "hidden_act": "silu",
        "attention_dropout": 0.0, "use_cache": True,
        "torch_dtype": {jnp.float32: "float32", jnp.bfloat16: "bfloat16",
                        jnp.float16: "float16"}[jnp.dtype(self.param_dtype).type],
    }


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
