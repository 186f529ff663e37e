"""Rotary position embeddings as HF computes them (default, linear, YaRN and Llama 3 scaling)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from trace_jax.models.decoder_config import DecoderConfig


def rope_frequencies(cfg: DecoderConfig) -> tuple[np.ndarray, float]:
  """Returns (inv_freq: f32[head_dim // 2], attention_scaling) following HF's rope init
  functions."""
  dim, base = cfg.head_dim, cfg.rope_theta
  pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
  inv_freq = (1.0 / pos_freqs).astype(np.float32)
  scaling = dict(cfg.rope_scaling or ())
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind == "default":
    return inv_freq, 1.0
  factor = float(scaling["factor"])
  if kind == "linear":
    return (inv_freq / factor).astype(np.float32), 1.0
  if kind == "yarn":
    return _yarn(cfg, scaling, inv_freq, pos_freqs, factor)
  if kind == "llama3":
    return _llama3(scaling, inv_freq, factor), 1.0
  raise NotImplementedError(f"rope scaling type {kind!r} is not implemented")


def _yarn(cfg, scaling, inv_freq, pos_freqs, factor):
  dim, base = cfg.head_dim, cfg.rope_theta

  def get_mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

  attention_factor = scaling.get("attention_factor")
  mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
  if attention_factor is None:
    if mscale and mscale_all:
      attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
    else:
      attention_factor = get_mscale(factor)
  beta_fast = scaling.get("beta_fast") or 32
  beta_slow = scaling.get("beta_slow") or 1
  orig = scaling.get("original_max_position_embeddings") or cfg.max_position_embeddings

  def correction_dim(rot):
    return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

  low, high = correction_dim(beta_fast), correction_dim(beta_slow)
  if scaling.get("truncate", True):
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  extrap = 1 - ramp
  inv_interp = 1.0 / (factor * pos_freqs)
  inv = inv_interp * (1 - extrap) + inv_freq * extrap
  return inv.astype(np.float32), float(attention_factor)


def _llama3(scaling, inv_freq, factor):
  """Llama 3.1's scaling: wavelengths past the original context's / low_freq_factor are divided
  by `factor`, those under its / high_freq_factor kept, and the band between interpolated."""
  low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
  orig = float(scaling["original_max_position_embeddings"])
  wavelen = (2 * math.pi / inv_freq).astype(np.float32)
  scaled = np.where(wavelen > orig / low, inv_freq / factor, inv_freq).astype(np.float32)
  smooth = ((orig / wavelen - low) / (high - low)).astype(np.float32)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = (wavelen >= orig / high) & (wavelen <= orig / low)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(positions: jnp.ndarray, cfg: DecoderConfig) -> tuple[jnp.ndarray, jnp.ndarray]:
  """positions: i32[B, T] -> cos, sin: f32[B, T, head_dim] (halves repeated, HF layout)."""
  inv_freq, scale = rope_frequencies(cfg)
  freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb) * scale, jnp.sin(emb) * scale


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
  """x: [B, T, H, D]; cos/sin: [B, T, D]. Rotates the two halves of the head dim (HF convention)."""
  half = x.shape[-1] // 2
  x1, x2 = x[..., :half], x[..., half:]
  rot = jnp.concatenate([-x2, x1], axis=-1)
  cos, sin = cos[:, :, None, :], sin[:, :, None, :]
  xf = x.astype(jnp.float32)
  return (xf * cos + rot.astype(jnp.float32) * sin).astype(x.dtype)
