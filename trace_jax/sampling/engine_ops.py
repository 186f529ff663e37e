"""Jitted device steps of the sampler: batched decode over all slots, chunked prefill, sampling.

Everything here is a pure function of (params state, KV pool, int/float arrays) with static shapes;
the host engine (`engine.py`) only builds the index arrays. The pool is donated to every step, so
K/V writes happen in place instead of copying the whole pool each token. Given a `PoolLayout` (a
mesh), the steps take explicit in/out shardings and everything that indexes the pool runs per data
shard under `shard_map`, so the pool is never gathered.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from trace_jax.kernels import paged_attention_reference, tree_attention, tree_attention_sharded
from trace_jax.sampling.paged_kv import (PoolLayout, jit_pool_fn, paged_prefill_attention,
                                        write_tokens)


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
    tokens i32[S]; logprob f32[S]: log mu(token) under the behaviour distribution mu the token was
    actually drawn from, softmax(logits / T) restricted to the tokens top-k / top-p keep and
    renormalized (PPO's ratio divides the update's tempered pi(token) by it, so the ratio is the
    importance weight of the filtered sampler); when the filters keep the whole vocabulary it is
    exactly the tempered log-softmax, bit for bit (also what nucleus=False and max_top_k=0 give).
    entropy f32[S]: of the tempered, unfiltered softmax(logits / T) (a diagnostic; the loss's
    entropy term recomputes that one). Greedy slots report the untempered, unfiltered log-prob and
    entropy (T = 1) of the argmax.
  """
  logits = logits.astype(jnp.float32)
  n_rows = logits.shape[0]
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
    # Rows whose candidates are the whole vocabulary, all kept, sample from softmax(scaled) itself.
    unfiltered = jnp.all(keep, axis=-1) if n == logits.shape[-1] else jnp.zeros(n_rows, bool)
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
  if max_top_k > 0 or nucleus:
    # The sampled candidate is always a kept one (the cdf is flat past the kept prefix), so its
    # log-prob under the renormalized kept set is finite.
    kept_lp = jnp.take_along_axis(jax.nn.log_softmax(cand, axis=-1), idx[:, None], axis=-1)[:, 0]
    lp = jnp.where(greedy | unfiltered, lp, kept_lp)
  return tokens, lp, entropy


def _pool_specs(layout, pool):
  return jax.tree.map(lambda _: layout.pool_spec, pool)


def _write_decode(layout, kp, vp, k, v, page, off):
  """Writes one token per slot (k, v: [S, Hkv, hd]) at global (page, off), per shard on a mesh."""
  if layout is None:
    return write_tokens(kp, k, page, off), write_tokens(vp, v, page, off)

  def local(kp, vp, k, v, page, off):
    page = page - layout.shard_index() * kp.shape[0]
    return write_tokens(kp, k, page, off), write_tokens(vp, v, page, off)

  rows, heads = layout.rows, layout.head_axis
  pool, tok = layout.pool_spec, P(rows, heads, None)
  fn = jax.shard_map(local, mesh=layout.mesh, in_specs=(pool, pool, tok, tok, P(rows), P(rows)),
                     out_specs=(pool, pool), check_vma=False)
  return fn(kp, vp, k, v, page, off)


def _stop_matches(window, stop_seqs):
  """window i32[S, L] (the turn's last L tokens, left padded with -2); stop_seqs i32[NS, L] (left
  padded with -1, a wildcard) -> bool[S]: some stop sequence ends the window."""
  hit = (stop_seqs[None] == -1) | (window[:, None, :] == stop_seqs[None])
  return jnp.any(jnp.all(hit, axis=-1), axis=-1)


def stop_sequence_table(stop_seqs) -> np.ndarray:
  """Token-id stop sequences -> i32[NS, L] left padded with -1 (a row that never matches when
  there are none)."""
  seqs = [tuple(int(t) for t in s) for s in stop_seqs if len(s)]
  width = max([len(s) for s in seqs] + [1])
  out = np.full((max(1, len(seqs)), width), -1, np.int32)
  if not seqs:
    out[:] = -3  # tokens are >= 0 and window padding is -2: nothing matches
  for i, seq in enumerate(seqs):
    out[i, width - len(seq):] = seq
  return out


@functools.lru_cache(maxsize=16)
def make_decode_step(graphdef, attention_impl: str = "auto", max_top_k: int = 0,
                     nucleus: bool = True, layout: PoolLayout | None = None, steps: int = 1,
                     stop_seqs: tuple = (), eos_id: int | None = None):
  """Builds the jitted decode step (cached per model graph, so engines share compilations).

  step(state, pool, batch) -> (pool, out): up to `steps` decode steps of every busy slot in one
  device call (a `lax.while_loop`), each slot stopping on its own at EOS, at a token-id stop
  sequence or when its step budget is spent; the loop ends when no slot is left or after `steps`.
  batch (numpy or device arrays):
    tokens, positions: i32[S] the pending (input) token of each slot and its position (= tokens
      with K/V before the call);
    write_pages: i32[S, W] the slot's pages from index positions // page_size on (the K/V of
      position p goes to write_pages[p // ps - positions // ps] at offset p % ps);
    budget: i32[S] steps the slot may take (0: inactive; its writes go to `null`); null: i32[S]
      the null page of the slot's shard; window: i32[S, L] the turn's last L tokens (-2 padding),
      L = the stop table's width;
    attention tables, tree form `group_pages i32[NG,Pg], group_lens i32[NG],
      group_slots i32[NG,B], suffix_pages i32[S,Ps], suffix_lens i32[S]` or plain form
      `page_table i32[S,P], lens i32[S]`, lengths including the first step's token (each step adds
      one to a running slot's suffix or plain length; the tables cover all its steps);
    keys u32[S,2], counters i32[S] (step j uses counters + j), temperature f32[S], top_p f32[S],
    top_k i32[S], greedy bool[S].
  max_top_k, nucleus: static sampling-filter switches (see `sample_tokens`).
  layout: `PoolLayout` of a mesh: the pool and every per-slot array are split over its data
    shards, attention runs in `tree_attention_sharded` (tree tables required), K/V writes under
    `shard_map`; in and out shardings are explicit and the pool is donated.
  stop_seqs: static tuple of token-id tuples; eos_id: static.
  out: tokens i32[S, steps], logprobs f32[S, steps] (under the filtered, renormalized distribution
  each token was drawn from: `sample_tokens`), entropy f32[S, steps] (entries past a slot's count
  are garbage), count i32[S] (steps taken), hidden f32[S, D] (first step, after the final norm:
  the predictor feature of the input token's prefix).
  One compilation per distinct table shape (the engine buckets them).
  """
  stop_table = stop_sequence_table(stop_seqs)

  def step(state, pool, batch):
    model = nnx.merge(graphdef, state)
    tree_mode = "group_pages" in batch
    if layout is not None and not tree_mode:
      raise ValueError("a sharded decode step takes tree tables")
    s = batch["tokens"].shape[0]
    ps = pool["k"][0].shape[1]
    base = batch["positions"] // ps
    eos = -1 if eos_id is None else int(eos_id)
    stops = jnp.asarray(stop_table)

    def one(j, carry):
      pool, tok, pos, count, active, window = carry[:6]
      idx = jnp.clip(pos // ps - base, 0, batch["write_pages"].shape[1] - 1)
      page = jnp.take_along_axis(batch["write_pages"], idx[:, None], axis=1)[:, 0]
      page = jnp.where(active, page, batch["null"])
      off = pos % ps

      def attend(i, q, k, v):
        kp, vp = _write_decode(layout, pool["k"][i], pool["v"][i], k[:, 0], v[:, 0], page, off)
        if tree_mode:
          args = (q[:, 0], kp, vp, batch["group_pages"], batch["group_lens"],
                  batch["group_slots"], batch["suffix_pages"], batch["suffix_lens"] + count)
          if layout is None:
            o = tree_attention(*args, impl=attention_impl)
          else:
            o = tree_attention_sharded(*args, mesh=layout.mesh, data_axes=layout.data_axes,
                                       head_axis=layout.head_axis, impl=attention_impl)
        else:
          o = paged_attention_reference(q[:, 0], kp, vp, batch["page_table"],
                                        batch["lens"] + count)
        return o[:, None].astype(q.dtype), (kp, vp)

      hidden, _, auxs = model.run_layers(tok[:, None], pos[:, None], attend)
      h = hidden[:, 0]
      new, lp, ent = sample_tokens(model.logits(h), batch["keys"], batch["counters"] + count,
                                   batch["temperature"], batch["top_p"], batch["top_k"],
                                   batch["greedy"], max_top_k=max_top_k, nucleus=nucleus)
      pool = {"k": [a[0] for a in auxs], "v": [a[1] for a in auxs]}
      window = jnp.where(active[:, None], jnp.concatenate([window[:, 1:], new[:, None]], 1),
                         window)
      count = count + active
      ended = (new == eos) | _stop_matches(window, stops) | (count >= batch["budget"])
      return pool, jnp.where(active, new, tok), pos + active, count, active & ~ended, window, h, \
          new, lp, ent

    def cond(carry):
      return (carry[-1] < steps) & jnp.any(carry[4])

    def body(carry):
      *c, outs, j = carry
      pool, tok, pos, count, active, window, h, new, lp, ent = one(j, c[:6])
      toks, lps, ents, h0 = outs
      toks = toks.at[:, j].set(new)
      lps = lps.at[:, j].set(lp)
      ents = ents.at[:, j].set(ent)
      h0 = jnp.where(j == 0, h.astype(jnp.float32), h0)
      return pool, tok, pos, count, active, window, (toks, lps, ents, h0), j + 1

    d = model.cfg.hidden_size
    outs = (jnp.zeros((s, steps), jnp.int32), jnp.zeros((s, steps), jnp.float32),
            jnp.zeros((s, steps), jnp.float32), jnp.zeros((s, d), jnp.float32))
    carry = (pool, batch["tokens"], batch["positions"], jnp.zeros(s, jnp.int32),
             batch["budget"] > 0, batch["window"], outs, jnp.int32(0))
    pool, _, _, count, _, _, (toks, lps, ents, h0), _ = jax.lax.while_loop(cond, body, carry)
    return pool, dict(tokens=toks, logprobs=lps, entropy=ents, count=count, hidden=h0)

  if layout is None:
    return jax.jit(step, donate_argnums=(1,))
  rows = layout.row_sharding
  return jit_pool_fn(step, (None, layout.pool_sharding, rows), donate_argnums=(1,),
                     out_shardings=(layout.pool_sharding, rows))


def _prefill_local(q, k, v, kp, vp, table, start, num_new, offset):
  """Writes a chunk's K/V and attends over its pages; table holds page ids minus `offset`."""
  b, c = q.shape[:2]
  ps = kp.shape[1]
  table = table - offset
  pos = start[:, None] + jnp.arange(c, dtype=jnp.int32)[None]
  real = jnp.arange(c)[None, :] < num_new[:, None]
  page = jnp.take_along_axis(table, jnp.clip(pos // ps, 0, table.shape[1] - 1), axis=1)
  page = jnp.where(real, page, 0).reshape(-1)  # padding: the (local) null page
  off = (pos % ps).reshape(-1)
  kp = write_tokens(kp, k.reshape(b * c, *k.shape[2:]), page, off)
  vp = write_tokens(vp, v.reshape(b * c, *v.shape[2:]), page, off)
  return paged_prefill_attention(q, kp, vp, table, start, num_new), kp, vp


@functools.lru_cache(maxsize=16)
def make_prefill_step(graphdef, layout: PoolLayout | None = None):
  """Builds the jitted chunked prefill (cached per model graph): writes row chunks into pages.

  step(state, pool, batch) -> (pool, last f32[B, D], total f32[B, D]): the final hidden state at
  each row's last real token of the chunk and its sum over the chunk's real tokens (a prompt
  prefilled whole yields its predictor features with its K/V), with batch:
    tokens i32[B, C] (right padded), table i32[B, Pt], start i32[B] (tokens already written),
    num_new i32[B] (real tokens in the chunk; 0 for an unused row).
  Positions are start + t. Padded tokens write to the null page. One compilation per (B, C, Pt).
  With a `layout`, rows split over its data shards (block s holds rows of shard s's pages, padded
  table entries point at that shard's null page) and each shard writes and attends locally.
  """

  def step(state, pool, batch):
    model = nnx.merge(graphdef, state)
    tokens, table = batch["tokens"], batch["table"]
    start, num_new = batch["start"], batch["num_new"]
    c = tokens.shape[1]
    pos = start[:, None] + jnp.arange(c, dtype=jnp.int32)[None]

    def attend(i, q, k, v):
      if layout is None:
        o, kp, vp = _prefill_local(q, k, v, pool["k"][i], pool["v"][i], table, start, num_new, 0)
        return o, (kp, vp)

      def local(q, k, v, kp, vp, table, start, num_new):
        off = layout.shard_index() * kp.shape[0]
        return _prefill_local(q, k, v, kp, vp, table, start, num_new, off)

      rows, heads = layout.rows, layout.head_axis
      act = P(rows, None, heads, None)
      fn = jax.shard_map(local, mesh=layout.mesh,
                         in_specs=(act, act, act, layout.pool_spec, layout.pool_spec,
                                   P(rows, None), P(rows), P(rows)),
                         out_specs=(act, layout.pool_spec, layout.pool_spec), check_vma=False)
      o, kp, vp = fn(q, k, v, pool["k"][i], pool["v"][i], table, start, num_new)
      return o, (kp, vp)

    hidden, _, auxs = model.run_layers(tokens, pos, attend)
    pool = {"k": [a[0] for a in auxs], "v": [a[1] for a in auxs]}
    hidden = hidden.astype(jnp.float32)
    real = (jnp.arange(c)[None, :] < num_new[:, None]).astype(jnp.float32)[..., None]
    last = jnp.take_along_axis(hidden, jnp.maximum(num_new - 1, 0)[:, None, None], axis=1)[:, 0]
    return pool, last, (hidden * real).sum(1)

  if layout is None:
    return jax.jit(step, donate_argnums=(1,))
  return jit_pool_fn(step, (None, layout.pool_sharding, layout.row_sharding), donate_argnums=(1,),
                     out_shardings=(layout.pool_sharding, layout.row_sharding, layout.row_sharding))


@functools.lru_cache(maxsize=16)
def make_feature_step(graphdef, layout: PoolLayout | None = None, prompt_mean: bool = False):
  """Jitted plain forward returning the final hidden state at each row's last real token.

  step(state, tokens i32[B, T] right padded, lens i32[B]) -> f32[B, D]. One compilation per (B, T).
  With `prompt_mean` (rows are prompts): f32[B, 2D], that state and the mean of the final states
  over the row's tokens (the predictor feature "last+prompt_mean" of a prompt).
  With a `layout`, rows split over its data shards (B a multiple of the shards) and the weights
  stay as they are laid out for sampling, so prompt scoring runs on the sampler's mesh.
  """

  def step(state, tokens, lens):
    model = nnx.merge(graphdef, state)
    mask = jnp.arange(tokens.shape[1])[None, :] < lens[:, None]
    hidden = model.forward(tokens, attn_mask=mask, compute_logits=False)["hidden"]
    hidden = hidden.astype(jnp.float32)
    last = jnp.maximum(lens - 1, 0)
    out = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    if prompt_mean:
      m = mask.astype(jnp.float32)[..., None]
      mean = (hidden * m).sum(1) / jnp.maximum(m.sum(1), 1.0)
      out = jnp.concatenate([out, mean], axis=-1)
    return out

  if layout is None:
    return jax.jit(step)
  return jit_pool_fn(step, (None, layout.row_sharding, layout.row_sharding),
                     out_shardings=layout.row_sharding)


__all__ = ["make_decode_step", "make_feature_step", "make_prefill_step", "sample_tokens",
           "stop_sequence_table"]
