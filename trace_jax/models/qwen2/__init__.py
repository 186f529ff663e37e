"""Qwen2 / Qwen2.5 decoder (Flax NNX), presets and HF import/export."""

from trace_jax.models.qwen2.config import PRESETS, Qwen2Config, get_preset
from trace_jax.models.qwen2.model import Qwen2
from trace_jax.models.qwen2.params import from_pretrained, load_config, save_pretrained

__all__ = ["PRESETS", "Qwen2", "Qwen2Config", "from_pretrained", "get_preset", "load_config",
           "save_pretrained"]
