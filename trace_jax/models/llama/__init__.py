"""Llama 3.x decoder (Flax NNX), presets and HF import/export."""

from trace_jax.models.llama.config import PRESETS, LlamaConfig, get_preset
from trace_jax.models.llama.model import Llama
from trace_jax.models.llama.params import from_pretrained, load_config, save_pretrained

__all__ = ["PRESETS", "Llama", "LlamaConfig", "from_pretrained", "get_preset", "load_config",
           "save_pretrained"]
