"""HF checkpoint import/export for Qwen2 / Qwen2.5 (`model_type` "qwen2"): the shared
`models.hf_checkpoint` bound to `Qwen2Config` and `Qwen2`."""

from __future__ import annotations

from trace_jax.models import hf_checkpoint
from trace_jax.models.hf_checkpoint import save_pretrained
from trace_jax.models.qwen2.config import Qwen2Config
from trace_jax.models.qwen2.model import Qwen2
from trace_jax.parallel.sharding import DEFAULT_RULES


def load_config(path: str, **overrides) -> Qwen2Config:
  """The `Qwen2Config` of checkpoint directory `path` (its `config.json`), with field overrides."""
  return hf_checkpoint.load_config(path, Qwen2Config, **overrides)


def from_pretrained(path: str, dtype=None, param_dtype=None, mesh=None, rules=DEFAULT_RULES,
                    **config_overrides) -> Qwen2:
  """Loads an HF Qwen2 / Qwen2.5 checkpoint directory into a `Qwen2`; the arguments are
  `hf_checkpoint.load_pretrained`'s (lazy per-shard reads, placement on `mesh`)."""
  return hf_checkpoint.load_pretrained(path, Qwen2Config, Qwen2, dtype, param_dtype, mesh,
                                       rules, **config_overrides)


__all__ = ["from_pretrained", "load_config", "save_pretrained"]
