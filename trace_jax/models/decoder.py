"""The decoder every model family runs (Flax NNX), used functionally (split to (graphdef, state),
merge inside jit): pre-norm GQA attention with rotary positions and a SwiGLU MLP, with the family
switches of `DecoderConfig` (q/k/v biases, q/k norms, rope scaling, tied embeddings). A family is a
subclass of `Decoder` with its own config class (`models.qwen3`, `models.qwen2`, `models.llama`).
Each projection adds its LoRA adapter's output when one is attached (`models.lora`).

Padding and segment contract (tested in tests/test_qwen3_model.py):
- `attn_mask: bool[B, T]` marks real tokens. Without a cache, a real token attends causally to the
  real tokens of its own row (and of its own segment when `segment_ids` is given); pad tokens are
  never attended to. Logits at pad positions are finite but meaningless.
- `segment_ids: i32[B, T]` packs several sequences in one row: tokens attend only within their
  segment; segment 0 means padding. Positions must restart per segment (the caller passes them).
- `kv_end: i32[B, T]` packs trees (`trace_jax.rl.batch`, tree packing): a key at row index k is
  seen by the queries at indices k..kv_end[k]-1 only. With nodes laid out in preorder, kv_end of a
  node's tokens is the end of its subtree, so each token attends exactly to its ancestors' tokens
  and its own node's causal past; positions are then the tokens' depths along their root paths.
- `kv_blocks=(blocks i32[B, nQ, M], counts i32[B, nQ])` (`models.blocked_attention.kv_block_lists`
  of the same kv_end / segment_ids / attn_mask) runs the cache-free attention over the listed key
  blocks only (no [T, T] mask is built); the result is the dense mask's.
- With a cache, new tokens are written at index `cache["lens"][b] + t`; padding must be on the
  right of each row's chunk, and `lens` advances by the number of real tokens.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from trace_jax.models import lora
from trace_jax.models.attention import dense_attention
from trace_jax.models.blocked_attention import blocked_attention
from trace_jax.models.decoder_config import DecoderConfig
from trace_jax.models.rope import apply_rope, rope_cos_sin

# Per-layer rematerialization policies (None: save nothing but the layer input).
REMAT_POLICIES = {"none": None, "full": None,
                  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def _param(rngs, shape, axes, dtype, std=0.02):
  return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32).astype(dtype) * std,
                   logical_axes=axes)


def _ones(shape, axes, dtype):
  return nnx.Param(jnp.ones(shape, dtype), logical_axes=axes)


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, eps: float, dtype, axis_name: str = "norm"):
    self.weight = _ones((dim,), (axis_name,), dtype)
    self.eps = eps

  def __call__(self, x):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return (self.weight[...].astype(jnp.float32) * xf).astype(x.dtype)


class Attention(nnx.Module):
  def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
    d, h, kv, hd, pd = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.param_dtype)
    self.cfg = cfg
    self.q_proj = _param(rngs, (d, h, hd), ("embed", "heads", "head_dim"), pd)
    self.k_proj = _param(rngs, (d, kv, hd), ("embed", "kv_heads", "head_dim"), pd)
    self.v_proj = _param(rngs, (d, kv, hd), ("embed", "kv_heads", "head_dim"), pd)
    self.o_proj = _param(rngs, (h, hd, d), ("heads", "head_dim", "embed"), pd)
    if cfg.attention_bias:
      self.q_bias = nnx.Param(jnp.zeros((h, hd), pd), logical_axes=("heads", "head_dim"))
      self.k_bias = nnx.Param(jnp.zeros((kv, hd), pd), logical_axes=("kv_heads", "head_dim"))
      self.v_bias = nnx.Param(jnp.zeros((kv, hd), pd), logical_axes=("kv_heads", "head_dim"))
    if cfg.qk_norm:
      self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, pd, "head_dim")
      self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, pd, "head_dim")

  def qkv(self, x, cos, sin):
    """x: [B, T, D] -> q: [B, T, H, hd], k, v: [B, T, Hkv, hd] (normed if `qk_norm`, rotated)."""
    dt = self.cfg.dtype
    q = lora.delta(self, "q_proj", x, jnp.einsum("btd,dhk->bthk", x, self.q_proj[...].astype(dt)))
    k = lora.delta(self, "k_proj", x, jnp.einsum("btd,dhk->bthk", x, self.k_proj[...].astype(dt)))
    v = lora.delta(self, "v_proj", x, jnp.einsum("btd,dhk->bthk", x, self.v_proj[...].astype(dt)))
    if self.cfg.attention_bias:
      q, k, v = (q + self.q_bias[...].astype(dt), k + self.k_bias[...].astype(dt),
                 v + self.v_bias[...].astype(dt))
    if self.cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

  def out(self, o):
    return lora.delta(self, "o_proj", o,
                      jnp.einsum("bthk,hkd->btd", o, self.o_proj[...].astype(self.cfg.dtype)))


class MLP(nnx.Module):
  def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
    d, f, pd = cfg.hidden_size, cfg.intermediate_size, cfg.param_dtype
    self.dtype = cfg.dtype
    self.gate_proj = _param(rngs, (d, f), ("embed", "mlp"), pd)
    self.up_proj = _param(rngs, (d, f), ("embed", "mlp"), pd)
    self.down_proj = _param(rngs, (f, d), ("mlp", "embed"), pd)

  def __call__(self, x):
    dt = self.dtype
    g = lora.delta(self, "gate_proj", x, x @ self.gate_proj[...].astype(dt))
    u = lora.delta(self, "up_proj", x, x @ self.up_proj[...].astype(dt))
    h = jax.nn.silu(g) * u
    return lora.delta(self, "down_proj", h, h @ self.down_proj[...].astype(dt))


class DecoderLayer(nnx.Module):
  def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
    self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
    self.self_attn = Attention(cfg, rngs)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
    self.mlp = MLP(cfg, rngs)


# attend(layer_index, q: [B, T, H, hd], k_new, v_new: [B, T, Hkv, hd]) -> (o: [B, T, H, hd], aux)
AttendFn = Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]


class Decoder(nnx.Module):
  """Causal LM. See the module docstring for the padding, segment and cache contract.

  `model(tokens i32[B, T])` returns logits f32[B, T, V]; with `cache=` (a pytree from
  `init_cache`, {"layers": [{"k", "v": [B, S, Hkv, hd]}] * L, "lens": i32[B]}) it returns
  (logits, new_cache), writing the new tokens at `lens` and advancing it. `forward` also returns
  the final hidden states [B, T, D] (the predictor's features). Used functionally:
  `graphdef, state = nnx.split(model)`, then `nnx.merge(graphdef, state)` inside a jitted function.

  Example:
    >>> model = Decoder(get_preset("tiny", vocab_size=64, num_layers=1), rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 5), jnp.int32)).shape
    (2, 5, 64)
    >>> logits, cache = model(jnp.zeros((2, 5), jnp.int32), cache=init_cache(model.cfg, 2, 16))
    >>> cache["lens"].tolist()  # the next tokens go to position 5
    [5, 5]
  """

  def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed_tokens = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"),
                               cfg.param_dtype)
    self.layers = nnx.List([DecoderLayer(cfg, rngs) for _ in range(cfg.num_layers)])
    self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
    if not cfg.tie_word_embeddings:
      self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"),
                            cfg.param_dtype)

  # ---- building blocks ---------------------------------------------------------------------------
  def embed(self, tokens):
    return jnp.take(self.embed_tokens[...], tokens, axis=0).astype(self.cfg.dtype)

  def logits(self, hidden):
    """hidden: [..., D] (after the final norm) -> f32[..., V]."""
    if self.cfg.tie_word_embeddings:
      w = self.embed_tokens[...].astype(self.cfg.dtype)
      return jnp.einsum("...d,vd->...v", hidden, w, preferred_element_type=jnp.float32)
    w = self.lm_head[...].astype(self.cfg.dtype)
    return jnp.einsum("...d,dv->...v", hidden, w, preferred_element_type=jnp.float32)

  def run_layers(self, tokens, positions, attend: AttendFn, collect_hidden=False,
                 remat: str = "none"):
    """Embeds, runs every layer with a caller-supplied attention, applies the final norm.

    remat: "none" | "full" | "dots" rematerializes each layer in the backward pass (`jax.checkpoint`
    per layer): "full" keeps only the layer's input, "dots" also keeps the weight matmuls' outputs
    (no batch dimensions) and recomputes attention scores and elementwise ops. `attend` must then be
    free of side effects (no cache writes).

    Returns (hidden: [B, T, D] after the final norm, per-layer hidden list (HF layout) or None,
    list of per-layer `aux` values returned by `attend`).
    """
    if remat not in REMAT_POLICIES:
      raise ValueError(f"remat={remat!r}; expected one of {sorted(REMAT_POLICIES)}")
    cos, sin = rope_cos_sin(positions, self.cfg)
    x = self.embed(tokens)
    hs = [x] if collect_hidden else None
    auxs = []
    for i, layer in enumerate(self.layers):
      def block(x, layer=layer, i=i):
        h = layer.input_layernorm(x)
        q, k, v = layer.self_attn.qkv(h, cos, sin)
        o, aux = attend(i, q, k, v)
        x = x + layer.self_attn.out(o)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x, aux
      if remat != "none":
        block = jax.checkpoint(block, policy=REMAT_POLICIES[remat])
      x, aux = block(x)
      auxs.append(aux)
      if collect_hidden and i < len(self.layers) - 1:
        hs.append(x)
    x = self.norm(x)
    if collect_hidden:
      hs.append(x)
    return x, hs, auxs

  # ---- contiguous forward with an optional KV cache ----------------------------------------------
  def forward(self, tokens, positions=None, cache=None, attn_mask=None, segment_ids=None,
              collect_hidden=False, compute_logits=True, remat: str = "none", kv_end=None,
              kv_blocks=None):
    """tokens: i32[B, T] -> dict(logits f32[B,T,V], hidden [B,T,D], cache, hidden_states).

    compute_logits=False skips the vocabulary projection (logits None), for callers that need
    logits at a few positions only (`self.logits(hidden[...])`). remat ("none" | "full" | "dots",
    see `run_layers`) applies to the cache-free (training) forward only. kv_end (i32[B, T], see the
    module docstring) narrows the cache-free mask to each key's subtree (packed trees); kv_blocks
    (blocks, counts) runs that mask block-sparse (`models.blocked_attention`).
    """
    maybe_logits = self.logits if compute_logits else (lambda h: None)
    b, t = tokens.shape
    if attn_mask is None:
      attn_mask = (segment_ids > 0) if segment_ids is not None else jnp.ones((b, t), bool)
    attn_mask = attn_mask.astype(bool)
    if cache is None:
      if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
      if kv_blocks is not None:
        def attend(i, q, k, v):
          return blocked_attention(q, k, v, *kv_blocks, kv_end, segment_ids, attn_mask), None

        hidden, hs, _ = self.run_layers(tokens, positions, attend, collect_hidden, remat)
        return dict(logits=maybe_logits(hidden), hidden=hidden, cache=None, hidden_states=hs)
      causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
      mask = causal[None] & attn_mask[:, None, :]
      if segment_ids is not None:
        mask &= segment_ids[:, :, None] == segment_ids[:, None, :]
      if kv_end is not None:
        mask &= jnp.arange(t)[None, :, None] < kv_end[:, None, :]
      mask |= jnp.eye(t, dtype=bool)[None]  # keeps pad rows finite

      def attend(i, q, k, v):
        return dense_attention(q, k, v, mask), None

      hidden, hs, _ = self.run_layers(tokens, positions, attend, collect_hidden, remat)
      return dict(logits=maybe_logits(hidden), hidden=hidden, cache=None, hidden_states=hs)

    if kv_end is not None or kv_blocks is not None:
      raise ValueError("kv_end and kv_blocks (packed rows) are for the cache-free forward only")
    lens = cache["lens"]
    if positions is None:
      positions = lens[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    s = cache["layers"][0]["k"].shape[1]
    kidx = jnp.arange(s)[None, None, :]
    qidx = lens[:, None, None] + jnp.arange(t)[None, :, None]
    rel = kidx - lens[:, None, None]
    new_valid = jnp.take_along_axis(attn_mask, jnp.clip(rel[:, 0], 0, t - 1), axis=1)[:, None]
    mask = (kidx <= qidx) & ((kidx < lens[:, None, None]) | ((rel < t) & new_valid))
    write = jax.vmap(lambda buf, new, start:
                     jax.lax.dynamic_update_slice_in_dim(buf, new, start, 0))
    new_layers = []

    def attend(i, q, k, v):
      kc = write(cache["layers"][i]["k"], k.astype(cache["layers"][i]["k"].dtype), lens)
      vc = write(cache["layers"][i]["v"], v.astype(cache["layers"][i]["v"].dtype), lens)
      new_layers.append({"k": kc, "v": vc})
      return dense_attention(q, kc.astype(q.dtype), vc.astype(q.dtype), mask), None

    hidden, hs, _ = self.run_layers(tokens, positions, attend, collect_hidden)
    new_cache = {"layers": new_layers, "lens": lens + attn_mask.sum(-1).astype(jnp.int32)}
    return dict(logits=maybe_logits(hidden), hidden=hidden, cache=new_cache, hidden_states=hs)

  def __call__(self, tokens, positions=None, cache=None, attn_mask=None, segment_ids=None):
    """Returns logits f32[B, T, V] without a cache, (logits, new_cache) with one."""
    out = self.forward(tokens, positions, cache, attn_mask, segment_ids)
    return out["logits"] if cache is None else (out["logits"], out["cache"])

  def init_cache(self, batch: int, max_len: int, dtype=None):
    return init_cache(self.cfg, batch, max_len, dtype)


def init_cache(cfg: DecoderConfig, batch: int, max_len: int, dtype=None) -> dict:
  """Contiguous KV cache: {"layers": [{"k","v": [B, S, Hkv, hd]}] * L, "lens": i32[B]}.

  Args:
    cfg: the model's config; batch: B rows; max_len: S positions per row; dtype: default cfg.dtype.

  Example:
    >>> cache = init_cache(get_preset("tiny"), batch=2, max_len=16)
    >>> len(cache["layers"]), cache["layers"][0]["k"].shape, cache["lens"].tolist()
    (3, (2, 16, 2, 32), [0, 0])
  """
  dtype = dtype or cfg.dtype
  shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
  return {"layers": [{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
                     for _ in range(cfg.num_layers)],
          "lens": jnp.zeros((batch,), jnp.int32)}


def cache_logical_axes() -> tuple[str, ...]:
  return ("batch", "seq", "kv_heads", "head_dim")
