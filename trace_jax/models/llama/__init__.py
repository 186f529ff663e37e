"""Llama 3.x decoder (Flax NNX) and presets;
HF import/export through `trace_jax.models.from_pretrained` / `save_pretrained`."""

from trace_jax.models.llama.config import PRESETS, LlamaConfig, get_preset
from trace_jax.models.llama.model import Llama

__all__ = ["PRESETS", "Llama", "LlamaConfig", "get_preset"]
