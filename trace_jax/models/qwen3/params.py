"""HF checkpoint import/export for Qwen3: `from_pretrained`, `save_pretrained`, `load_config`.

The work is the families' shared `models.hf_checkpoint` (lazy per-shard safetensors reads, sharded
placement on a mesh, sharded export); this module binds it to `Qwen3Config` and `Qwen3`.
`trace_jax.models.from_pretrained` reads any family's checkpoint.
"""

from __future__ import annotations

from trace_jax.models import hf_checkpoint
from trace_jax.models.hf_checkpoint import save_pretrained
from trace_jax.models.qwen3.config import Qwen3Config
from trace_jax.models.qwen3.model import Qwen3
from trace_jax.parallel.sharding import DEFAULT_RULES


def load_config(path: str, **overrides) -> Qwen3Config:
  """The `Qwen3Config` of checkpoint directory `path` (its `config.json`), with field overrides."""
  return hf_checkpoint.load_config(path, Qwen3Config, **overrides)


def from_pretrained(path: str, dtype=None, param_dtype=None, mesh=None, rules=DEFAULT_RULES,
                    **config_overrides) -> Qwen3:
  """Loads an HF Qwen3 checkpoint directory (config.json + safetensors) into our model.

  dtype: compute dtype; param_dtype: storage dtype (default: `dtype`, else float32). With `mesh`,
  each parameter is placed directly in its logical sharding. Tensors are read lazily from
  `model.safetensors` or the shards of `model.safetensors.index.json`; `config_overrides` replace
  fields of the config read from `config.json`. Returns a `Qwen3` (an nnx module).

  Example:
    >>> save_pretrained(Qwen3(get_preset("tiny", num_layers=1), rngs=nnx.Rngs(0)),
    ...                 path := tempfile.mkdtemp())
    >>> model = from_pretrained(path, dtype="float32")
    >>> model.cfg.num_layers, model(jnp.zeros((1, 4), jnp.int32)).shape
    (1, (1, 4, 2048))
  """
  return hf_checkpoint.load_pretrained(path, Qwen3Config, Qwen3, dtype, param_dtype, mesh, rules,
                                       **config_overrides)


__all__ = ["from_pretrained", "load_config", "save_pretrained"]
