"""Qwen2 / Qwen2.5 decoder (Flax NNX) and presets;
HF import/export through `trace_jax.models.from_pretrained` / `save_pretrained`."""

from trace_jax.models.qwen2.config import PRESETS, Qwen2Config, get_preset
from trace_jax.models.qwen2.model import Qwen2

__all__ = ["PRESETS", "Qwen2", "Qwen2Config", "get_preset"]
