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


def sample_tokens(logits, keys, counters, temperature, top_p, top_k, greedy, *,
                  max_top_k: int = 0, nucleus: bool = True):
  """Per-slot temperature / top-k / top-p / greedy sampling.

  Args:
    logits: f32[S, V]; keys: u32[S, 2] per-branch threefry key data; counters: i32[S] per-branch
      step (folded into the key, so a branch's samples do not depend on which slot it runs in);
    temperature, top_p: f32[S]; top_k: i32[S] (<= 0: off); greedy: bool[S].
    max_top_k: static cap on top_k. > 0 restricts sampling to the `max_top_k` best tokens
      (`lax.top_k`, cheap) and per-slot top_k/top_p act inside them; 0 keeps the whole vocabulary.
    nucleus: static; False skips top-p/top-k entirely, which avoids sorting the vocabulary (a full
      sort of [S, V] dominates a small model's decode step on CPU).

  Returns:
    tokens i32[S], logprob f32[S] and entropy f32[S] of the tempered, unfiltered distribution
    softmax(logits / T) the tokens are drawn from (what the policy-gradient loss recomputes with
    the same temperature); greedy slots report the untempered one (T = 1).
  """
  logits = logits.astype(jnp.float32)
  t = jnp.where(greedy, 1.0, jnp.maximum(temperature, 1e-6))
  scaled = logits / t[:, None]
  logp = jax.nn.log_softmax(scaled, axis=-1)
  entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
  if max_top_k > 0:
    cand, cand_ids = jax.lax.top_k(scaled, max_top_k)  # sorted, descending
  elif nucleus:
    cand_ids = jnp.argsort(-scaled, axis=-1)
    cand = jnp.take_along_axis(scaled, cand_ids, axis=-1)
  else:
    cand, cand_ids = scaled, None
  if max_top_k > 0 or nucleus:
    n = cand.shape[-1]
    rank = jnp.arange(n)[None, :]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, n), n)
    probs = jax.nn.softmax(cand, axis=-1)
    # Nucleus: the smallest prefix of sorted tokens whose mass reaches top_p (the top token is
    # always kept, the mass before it being 0).
    keep = (rank < k[:, None]) & ((jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None])
    cand = jnp.where(keep, cand, -jnp.inf)
  # Inverse-CDF sampling needs one uniform per slot, far cheaper than Gumbel noise over the vocab.
  step_keys = jax.vmap(jax.random.fold_in)(
      jax.random.wrap_key_data(keys, impl="threefry2x32"), counters)
  u = jax.vmap(lambda k: jax.random.uniform(k, ()))(step_keys)
  cdf = jnp.cumsum(jax.nn.softmax(cand, axis=-1), axis=-1)
  idx = jnp.sum(cdf < (u * cdf[:, -1])[:, None], axis=-1)
  idx = jnp.minimum(idx, cand.shape[-1] - 1)
  sampled = idx if cand_ids is None else jnp.take_along_axis(cand_ids, idx[:, None], axis=-1)[:, 0]
  tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
  lp = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
  return tokens, lp, entropy


@functools.lru_cache(maxsize=16)
def make_decode_step(graphdef, attention_impl: str = "auto", max_top_k: int = 0,
                     nucleus: bool = True):
  """Builds the jitted decode step (cached per model graph, so engines share compilations).

  step(state, pool, batch) -> (pool, out) with batch (numpy or device arrays):
    tokens, positions, write_page, write_off: i32[S] (the input token of each slot, whose K/V is
      written at (write_page, write_off); inactive slots write to the null page);
    attention tables, either tree form `group_pages i32[NG,Pg], group_lens i32[NG],
      group_slots i32[NG,B], suffix_pages i32[S,Ps], suffix_lens i32[S]` or plain form
      `page_table i32[S,P], lens i32[S]` (lengths include the new token);
    keys u32[S,2], counters i32[S], temperature f32[S], top_p f32[S], top_k i32[S], greedy bool[S].
  max_top_k, nucleus: static sampling-filter switches (see `sample_tokens`).
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
                                    batch["greedy"], max_top_k=max_top_k, nucleus=nucleus)
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


@functools.lru_cache(maxsize=16)
def make_feature_step(graphdef):
  """Jitted plain forward returning the final hidden state at each row's last real token.

  step(state, tokens i32[B, T] right padded, lens i32[B]) -> f32[B, D]. One compilation per (B, T).
  """

  def step(state, tokens, lens):
    model = nnx.merge(graphdef, state)
    mask = jnp.arange(tokens.shape[1])[None, :] < lens[:, None]
    hidden = model.forward(tokens, attn_mask=mask)["hidden"]
    last = jnp.maximum(lens - 1, 0)
    return jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0].astype(jnp.float32)

  return jax.jit(step)


__all__ = ["make_decode_step", "make_feature_step", "make_prefill_step", "sample_tokens"]
