"""Qwen3 decoder (Flax NNX), presets and HF import/export."""

from trace_jax.models.qwen3.config import PRESETS, Qwen3Config, get_preset
from trace_jax.models.qwen3.model import Qwen3, init_cache
from trace_jax.models.qwen3.params import from_pretrained, load_config, save_pretrained

__all__ = ["PRESETS", "Qwen3", "Qwen3Config", "from_pretrained", "get_preset", "init_cache",
           "load_config", "save_pretrained"]
