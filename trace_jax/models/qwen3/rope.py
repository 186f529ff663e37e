"""Rotary position embeddings of Qwen3: the shared `models.rope` (kept importable from here)."""

from trace_jax.models.rope import apply_rope, rope_cos_sin, rope_frequencies

__all__ = ["apply_rope", "rope_cos_sin", "rope_frequencies"]
