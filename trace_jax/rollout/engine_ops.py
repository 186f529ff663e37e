"""Jitted device steps of the sampler: batched decode over all slots, chunked prefill, sampling.

Everything here is a pure function of (params state, KV pool, int/float arrays) with static shapes;
the host engine (`sampler.py`) only builds the index arrays. The pool is donated to every step, so
K/V writes happen in place instead of copying the whole pool each token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from trace_jax.kernels.tree_attention import paged_attention_reference, tree_attention
from trace_jax.rollout.paged_kv import paged_prefill_attention, write_tokens


def sample_tokens(logits, keys, counters, temperature, top_p, top_k, greedy):
  """Per-slot temperature / top-k / top-p / greedy sampling.

  Args:
    logits: f32[S, V]; keys: u32[S, 2] per-branch threefry key data; counters: i32[S] per-branch
      step (folded into the key, so a branch's samples do not depend on which slot it runs in);
    temperature, top_p: f32[S]; top_k: i32[S] (<= 0: off); greedy: bool[S].

  Returns:
    tokens i32[S], logprob f32[S] and entropy f32[S] of the untempered, unfiltered distribution
    (what the policy-gradient loss recomputes).
  """
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
  v = logits.shape[-1]
  scaled = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)[:, None]
  desc = -jnp.sort(-scaled, axis=-1)
  k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
  kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)
  probs = jax.nn.softmax(desc, axis=-1)
  # Nucleus: keep the smallest prefix of the sorted tokens whose mass reaches top_p (the top token
  # is always kept because the mass before it is 0).
  keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]
  pth = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
  filtered = jnp.where(scaled >= jnp.maximum(kth, pth), scaled, -jnp.inf)
  step_keys = jax.vmap(jax.random.fold_in)(
      jax.random.wrap_key_data(keys, impl="threefry2x32"), counters)
  sampled = jax.vmap(jax.random.categorical)(step_keys, filtered)
  tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
  lp = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
  return tokens, lp, entropy


@functools.lru_cache(maxsize=16)
def make_decode_step(graphdef, attention_impl: str = "auto"):
  """Builds the jitted decode step (cached per model graph, so engines share compilations).

  step(state, pool, batch) -> (pool, out) with batch (numpy or device arrays):
    tokens, positions, write_page, write_off: i32[S] (the input token of each slot, whose K/V is
      written at (write_page, write_off); inactive slots write to the null page);
    attention tables, either tree form `group_pages i32[NG,Pg], group_lens i32[NG],
      group_slots i32[NG,B], suffix_pages i32[S,Ps], suffix_lens i32[S]` or plain form
      `page_table i32[S,P], lens i32[S]` (lengths include the new token);
    keys u32[S,2], counters i32[S], temperature f32[S], top_p f32[S], top_k i32[S], greedy bool[S].
  out: tokens i32[S], logprobs f32[S], entropy f32[S], hidden f32[S, D] (after the final norm, the
  predictor feature of the input token's prefix).
  One compilation per distinct table shape (the engine buckets them).
  """

  def step(state, pool, batch):
    model = nnx.merge(graphdef, state)
    tree_mode = "group_pages" in batch

    def attend(i, q, k, v):
      kp = write_tokens(pool["k"][i], k[:, 0], batch["write_page"], batch["write_off"])
      vp = write_tokens(pool["v"][i], v[:, 0], batch["write_page"], batch["write_off"])
      if tree_mode:
        o = tree_attention(q[:, 0], kp, vp, batch["group_pages"], batch["group_lens"],
                           batch["group_slots"], batch["suffix_pages"], batch["suffix_lens"],
                           impl=attention_impl)
      else:
        o = paged_attention_reference(q[:, 0], kp, vp, batch["page_table"], batch["lens"])
      return o[:, None].astype(q.dtype), (kp, vp)

    hidden, _, auxs = model.run_layers(batch["tokens"][:, None], batch["positions"][:, None],
                                       attend)
    h = hidden[:, 0]
    tokens, lp, ent = sample_tokens(model.logits(h), batch["keys"], batch["counters"],
                                    batch["temperature"], batch["top_p"], batch["top_k"],
                                    batch["greedy"])
    new_pool = {"k": [a[0] for a in auxs], "v": [a[1] for a in auxs]}
    return new_pool, dict(tokens=tokens, logprobs=lp, entropy=ent, hidden=h.astype(jnp.float32))

  return jax.jit(step, donate_argnums=(1,))


@functools.lru_cache(maxsize=16)
def make_prefill_step(graphdef):
  """Builds the jitted chunked prefill (cached per model graph): writes row chunks into pages.

  step(state, pool, batch) -> pool with batch:
    tokens i32[B, C] (right padded), table i32[B, Pt], start i32[B] (tokens already written),
    num_new i32[B] (real tokens in the chunk; 0 for an unused row).
  Positions are start + t. Padded tokens write to the null page. One compilation per (B, C, Pt).
  """

  def step(state, pool, batch):
    model = nnx.merge(graphdef, state)
    tokens, table = batch["tokens"], batch["table"]
    start, num_new = batch["start"], batch["num_new"]
    b, c = tokens.shape
    ps = pool["k"][0].shape[1]
    pos = start[:, None] + jnp.arange(c, dtype=jnp.int32)[None]
    real = jnp.arange(c)[None, :] < num_new[:, None]
    page = jnp.take_along_axis(table, jnp.clip(pos // ps, 0, table.shape[1] - 1), axis=1)
    page = jnp.where(real, page, 0).reshape(-1)
    off = (pos % ps).reshape(-1)

    def attend(i, q, k, v):
      kp = write_tokens(pool["k"][i], k.reshape(b * c, *k.shape[2:]), page, off)
      vp = write_tokens(pool["v"][i], v.reshape(b * c, *v.shape[2:]), page, off)
      return paged_prefill_attention(q, kp, vp, table, start, num_new), (kp, vp)

    _, _, auxs = model.run_layers(tokens, pos, attend)
    return {"k": [a[0] for a in auxs], "v": [a[1] for a in auxs]}

  return jax.jit(step, donate_argnums=(1,))


__all__ = ["make_decode_step", "make_prefill_step", "sample_tokens"]
