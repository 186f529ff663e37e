"""Configuration of the shared decoder (`models.decoder`) and its reading and writing of HF
`config.json`.

A family's config is a subclass of `DecoderConfig` that names its HF `model_type` and architecture,
sets its defaults (e.g. no q/k norm) and, where it needs to, refuses HF options the decoder does
not implement (sliding windows, biases on the output projection) rather than loading a model that
would compute something else.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax.numpy as jnp

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
ROPE_KINDS = ("linear", "yarn", "dynamic", "llama3")  # HF rope types read besides "default"


def resolve_dtype(dtype) -> Any:
  """Accepts a jnp dtype or one of 'float32', 'bfloat16', 'float16'."""
  if isinstance(dtype, str):
    if dtype not in _DTYPES:
      raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]
  return dtype


def dtype_name(dtype) -> str:
  """'float32' | 'bfloat16' | 'float16' for a jnp dtype (HF `torch_dtype`)."""
  return {jnp.float32: "float32", jnp.bfloat16: "bfloat16",
          jnp.float16: "float16"}[jnp.dtype(resolve_dtype(dtype)).type]


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """Hyper-parameters of a pre-norm GQA decoder with rotary positions and a SwiGLU MLP.

  `dtype` is the compute dtype, `param_dtype` the storage dtype of the weights. Norms, softmax and
  logits are always computed in float32. The family switches: `attention_bias` (biases on the
  q/k/v projections, not on the output one), `qk_norm` (an RMSNorm over each head's q and k before
  the rotation), `rope_scaling` (HF rope parameters beyond theta: linear, yarn, llama3) and
  `tie_word_embeddings`. `from_hf_dict` / `to_hf_dict` read and write HF `config.json` for the
  subclass's `MODEL_TYPE`.

  Example:
    >>> cfg = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
    ...                     num_heads=4, num_kv_heads=2, head_dim=8)
    >>> cfg.gqa_group, cfg.qk_norm, cfg.replace(dtype="bfloat16").dtype == jnp.bfloat16
    (2, True, True)
  """

  MODEL_TYPE: ClassVar[str] = ""  # HF config.json model_type a subclass reads and writes
  ARCHITECTURE: ClassVar[str] = ""  # HF architectures[0]
  DEFAULT_ROPE_THETA: ClassVar[float] = 10_000.0  # HF's default when config.json has no theta
  DEFAULT_RMS_NORM_EPS: ClassVar[float] = 1e-6
  DEFAULT_MAX_POSITIONS: ClassVar[int] = 2048

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
  qk_norm: bool = True

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim"):
      if int(getattr(self, name)) <= 0:
        raise ValueError(f"{type(self).__name__}.{name} must be positive, "
                         f"got {getattr(self, name)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                       f"num_kv_heads={self.num_kv_heads}")
    object.__setattr__(self, "dtype", resolve_dtype(self.dtype))
    object.__setattr__(self, "param_dtype", resolve_dtype(self.param_dtype))

  @property
  def gqa_group(self) -> int:
    return self.num_heads // self.num_kv_heads

  def replace(self, **kw) -> "DecoderConfig":
    return dataclasses.replace(self, **kw)

  # ---- HF config.json ----------------------------------------------------------------------------
  @classmethod
  def from_hf_dict(cls, d: dict, **overrides) -> "DecoderConfig":
    """Reads an HF `config.json` dict of this family (transformers 4.x `rope_theta`/`rope_scaling`
    or 5.x `rope_parameters`); `overrides` replace fields."""
    mt = d.get("model_type", cls.MODEL_TYPE)
    if mt != cls.MODEL_TYPE:
      raise ValueError(f"config.json model_type is {mt!r}; {cls.__name__} reads only "
                       f"{cls.MODEL_TYPE!r}")
    kw = cls.hf_fields(d)
    kw.update(overrides)
    return cls(**kw)

  @classmethod
  def hf_fields(cls, d: dict) -> dict:
    """The constructor's keyword arguments from an HF config dict (the fields every family shares;
    a family extends it with its own checks)."""
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads")
    missing = [k for k in required if k not in d]
    if missing:
      raise KeyError(f"config.json lacks required keys {missing}")
    act = d.get("hidden_act", "silu")
    if act != "silu":
      raise ValueError(f"hidden_act {act!r} is not supported (the decoder's MLP is SwiGLU)")
    rope = dict(d.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", None) or d.get("rope_theta", cls.DEFAULT_ROPE_THETA)
    scaling = rope or d.get("rope_scaling") or None
    if scaling:
      scaling = dict(scaling)
      kind = scaling.get("rope_type", scaling.get("type", "default"))
      if kind == "default":
        scaling = None
      elif kind not in ROPE_KINDS:
        raise ValueError(f"unsupported rope scaling type {kind!r} in config.json")
    heads = d["num_attention_heads"]
    return dict(
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"],
        num_heads=heads, num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        rms_norm_eps=d.get("rms_norm_eps", cls.DEFAULT_RMS_NORM_EPS), rope_theta=float(theta),
        rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
        tie_word_embeddings=d.get("tie_word_embeddings", False),
        attention_bias=d.get("attention_bias", False),
        max_position_embeddings=d.get("max_position_embeddings", cls.DEFAULT_MAX_POSITIONS))

  def to_hf_dict(self) -> dict:
    rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
    if self.rope_scaling:
      rope_parameters = dict(self.rope_scaling) | {"rope_theta": self.rope_theta}
    return {
        "architectures": [self.ARCHITECTURE], "model_type": self.MODEL_TYPE,
        "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps,
        "rope_theta": self.rope_theta,
        "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": self.attention_bias,
        "max_position_embeddings": self.max_position_embeddings, "hidden_act": "silu",
        "attention_dropout": 0.0, "use_cache": True, "torch_dtype": dtype_name(self.param_dtype),
    }
