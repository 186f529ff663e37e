"""HF checkpoint import/export for Llama 3.x (`model_type` "llama"): the shared
`models.hf_checkpoint` bound to `LlamaConfig` and `Llama`."""

from __future__ import annotations

from trace_jax.models import hf_checkpoint
from trace_jax.models.hf_checkpoint import save_pretrained
from trace_jax.models.llama.config import LlamaConfig
from trace_jax.models.llama.model import Llama
from trace_jax.parallel.sharding import DEFAULT_RULES


def load_config(path: str, **overrides) -> LlamaConfig:
  """The `LlamaConfig` of checkpoint directory `path` (its `config.json`), with field overrides."""
  return hf_checkpoint.load_config(path, LlamaConfig, **overrides)


def from_pretrained(path: str, dtype=None, param_dtype=None, mesh=None, rules=DEFAULT_RULES,
                    **config_overrides) -> Llama:
  """Loads an HF Llama 3.x checkpoint directory into a `Llama`; the arguments are
  `hf_checkpoint.load_pretrained`'s (lazy per-shard reads, placement on `mesh`)."""
  return hf_checkpoint.load_pretrained(path, LlamaConfig, Llama, dtype, param_dtype, mesh,
                                       rules, **config_overrides)


__all__ = ["from_pretrained", "load_config", "save_pretrained"]
