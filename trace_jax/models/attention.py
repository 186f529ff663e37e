"""Family-neutral attention math shared by the model families (`models.qwen3`) and the sampler
(`sampling.paged_kv`'s prefill over KV pages): plain masked softmax attention with grouped-query
heads. No parameters and no model configuration, so the sampler can use it without importing a
model family.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG = -1e30  # finite mask value: a fully masked row gives a uniform softmax, never NaN


def dense_attention(q, k, v, mask):
  """q: [B, T, H, D]; k, v: [B, S, Hkv, D]; mask: bool[B, T, S] -> [B, T, H, D] (f32 softmax).

  Heads are moved ahead of time and the GQA group is folded into the query rows, so both products
  are plain batched matmuls over (batch, kv head); this layout runs several times faster on CPU
  than contracting in the [B, T, H, D] layout.
  """
  b, t, h, d = q.shape
  s_len, hkv = k.shape[1], k.shape[2]
  g = h // hkv
  qg = q.reshape(b, t, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)
  kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
  s = jnp.einsum("bkmd,bksd->bkms", qg, kt, preferred_element_type=jnp.float32) * d ** -0.5
  s = s.reshape(b, hkv, g, t, s_len)
  s = jnp.where(mask[:, None, None], s, _NEG)
  p = jax.nn.softmax(s, axis=-1).reshape(b, hkv, g * t, s_len)
  o = jnp.einsum("bkms,bksd->bkmd", p.astype(v.dtype), vt, preferred_element_type=jnp.float32)
  o = o.reshape(b, hkv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)
  return o.astype(q.dtype)


__all__ = ["dense_attention"]
