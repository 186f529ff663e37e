"""The model families by HF `model_type`, and the functions that dispatch on it: `load_config`,
`from_pretrained`, `save_pretrained`, `get_preset`, `build_model`. What a family provides is
written in `trace_jax.models`' docstring.
"""

from __future__ import annotations

import dataclasses
import os

from flax import nnx

from trace_jax.models import hf_checkpoint
from trace_jax.models.decoder import Decoder
from trace_jax.models.decoder_config import DecoderConfig
from trace_jax.models.hf_checkpoint import save_pretrained
from trace_jax.models.llama import PRESETS as LLAMA_PRESETS
from trace_jax.models.llama import Llama, LlamaConfig
from trace_jax.models.qwen2 import PRESETS as QWEN2_PRESETS
from trace_jax.models.qwen2 import Qwen2, Qwen2Config
from trace_jax.models.qwen3 import PRESETS as QWEN3_PRESETS
from trace_jax.models.qwen3 import Qwen3, Qwen3Config
from trace_jax.parallel.sharding import DEFAULT_RULES


@dataclasses.dataclass(frozen=True)
class Family:
  """One model family: its HF `model_type`, config class, model class and named presets."""
  model_type: str
  config_cls: type[DecoderConfig]
  model_cls: type[Decoder]
  presets: dict


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("qwen3", Qwen3Config, Qwen3, QWEN3_PRESETS),
    Family("qwen2", Qwen2Config, Qwen2, QWEN2_PRESETS),
    Family("llama", LlamaConfig, Llama, LLAMA_PRESETS),
)}


def family(model_type: str) -> Family:
  """The family of an HF `model_type` (KeyError naming the known ones otherwise)."""
  if model_type not in FAMILIES:
    raise KeyError(f"model_type {model_type!r} is not supported; known: {sorted(FAMILIES)}")
  return FAMILIES[model_type]


def family_of(cfg: DecoderConfig) -> Family:
  """The family whose config class `cfg` is an instance of."""
  return family(type(cfg).MODEL_TYPE)


def load_config(path: str, **overrides) -> DecoderConfig:
  """The config of checkpoint directory `path`, of the family its `config.json` names.

  Example:
    >>> save_pretrained(Qwen3(get_preset("tiny", num_layers=1), rngs=nnx.Rngs(0)),
    ...                 path := tempfile.mkdtemp())
    >>> type(load_config(path)).__name__
    'Qwen3Config'
  """
  return hf_checkpoint.load_config(path, checkpoint_family(path).config_cls, **overrides)


def checkpoint_family(path: str) -> Family:
  """The family that checkpoint directory `path`'s `config.json` names (ValueError if none)."""
  d = hf_checkpoint.read_config_json(path)
  try:
    return family(d.get("model_type", "qwen3"))  # a config.json without one: as qwen3 reads it
  except KeyError as e:
    raise ValueError(f"{os.path.join(path, 'config.json')}: {e.args[0]}") from None


def from_pretrained(path: str, dtype=None, param_dtype=None, mesh=None, rules=DEFAULT_RULES,
                    **config_overrides) -> Decoder:
  """Loads an HF checkpoint directory of any supported family (its `config.json`'s `model_type`:
  qwen3, qwen2, llama) into that family's model: called on token ids i32[B, T] it gives logits
  f32[B, T, V].

  dtype: compute dtype; param_dtype: storage dtype (default: `dtype`, else float32). With `mesh`,
  each parameter is placed directly in its logical sharding. Tensors are read lazily from
  `model.safetensors` or the shards of `model.safetensors.index.json`; `config_overrides` replace
  fields of the config read from `config.json`.

  Example:
    >>> save_pretrained(Qwen3(get_preset("tiny", num_layers=1), rngs=nnx.Rngs(0)),
    ...                 path := tempfile.mkdtemp())
    >>> model = from_pretrained(path, dtype="float32")
    >>> type(model).__name__, model(jnp.zeros((1, 4), jnp.int32)).shape
    ('Qwen3', (1, 4, 2048))
  """
  fam = checkpoint_family(path)
  return hf_checkpoint.load_pretrained(path, fam.config_cls, fam.model_cls, dtype, param_dtype,
                                       mesh, rules, **config_overrides)


def get_preset(name: str, **overrides) -> DecoderConfig:
  """A named config of any family (qwen3's `tiny`, `qwen3_8b`; qwen2's `qwen2p5_7b`; llama's
  `llama3p1_8b`, ...), with field overrides.

  Example:
    >>> cfg = get_preset("llama3p1_8b", num_layers=2)
    >>> type(cfg).__name__, cfg.num_layers, cfg.hidden_size
    ('LlamaConfig', 2, 4096)
  """
  for fam in FAMILIES.values():
    if name in fam.presets:
      cfg = fam.presets[name]
      return cfg.replace(**overrides) if overrides else cfg
  known = sorted(n for fam in FAMILIES.values() for n in fam.presets)
  raise KeyError(f"unknown model preset {name!r}; known: {known}")


def build_model(cfg: DecoderConfig, rngs: nnx.Rngs) -> Decoder:
  """A randomly initialised model of `cfg`'s family."""
  return family_of(cfg).model_cls(cfg, rngs=rngs)


__all__ = ["FAMILIES", "Family", "build_model", "checkpoint_family", "family", "family_of",
           "from_pretrained", "get_preset", "load_config", "save_pretrained"]
