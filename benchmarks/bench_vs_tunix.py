"""Side-by-side throughput of our sampler (`SamplerEngine`) and Tunix's `Sampler` on CPU.

Tunix is not a dependency of this project; the benchmark runs in a separate virtualenv that holds
both packages, with this checkout on PYTHONPATH:

  python3 -m venv ../tunix_venv
  ../tunix_venv/bin/pip install "google-tunix==0.1.7" "transformers<5" matplotlib
  PYTHONPATH=$PWD nice -n 10 ../tunix_venv/bin/python benchmarks/bench_vs_tunix.py [--quick]

("transformers<5": google-tunix 0.1.7 pins safetensors<0.8 while transformers >= 5.24 needs
safetensors >= 0.8, so an unpinned install backtracks through every transformers release.) The
install brings jax 0.10.2 and flax 0.12.8, the versions this project runs on; nothing else of ours
is missing there (numpy, ml_collections, optax, safetensors come with Tunix).

Both samplers get the same random Qwen3 weights (ours are built, then copied into Tunix's Qwen3
module; Tunix's RoPE always uses theta 1e6, so the models here do too) and the run starts with a
sanity check: full-sequence logits of both modules on the same prompts, and greedy tokens of both
samplers for a few steps. Then, per workload, the two samplers alternate (ours, Tunix, ours, ...)
on identical requests: the first call of each compiles, the next `--reps` are timed end to end
(prefill, decode, host work, results back on the host) and the medians of generated tokens / wall
second are compared. The compile time is the first call's wall time minus the median call.

Workloads (all sampled at temperature 1, no top-p / top-k, no EOS: every row generates its budget):
  plain_<model>: a batch of independent prompts (64 tokens, 128 generated per row; 32 rows on a
    2-layer 128-wide model (l2_d128), 16 on an 8-layer 512-wide one (l8_d512), --plain-rows);
  grpo_<model>: groups of 8 samples of one prompt (512-token prompts, 128 generated; 2 groups,
    --grpo-prompts); ours
    prefills each prompt once and its 8 branches share the prompt's pages (tree attention), Tunix
    samples the batch of repeated prompts (its way to draw a group);
  tree_<model>: multi-turn rollouts with a fork round (a TRACE-like tree): per prompt (256 tokens)
    4 rollouts of 3 turns (32 generated tokens per turn, a 24-token observation after turns 1 and
    2), then 2 forks from each rollout's first turn that run turns 2 and 3 again. Ours runs it
    with `PromptRequest` and `ForkRequest` (KV of the prompt and the anchors is kept and shared);
    Tunix runs each turn as a plain batch of the full contexts (prompt, turns, observations so
    far), re-prefilled at every call. By default on l2_d128 only (--tree-models): on the larger
    model Tunix's re-prefills take minutes per call on this CPU.
Our engine's settings: one slot per row, decode_steps = the turn length (one device call per turn
on this workload; --decode-steps overrides), page size 16, tree attention on (it only changes
anything where branches share pages), leaf features off (Tunix computes none), one prefill call
for all prompts (tree workload: prompts and observations in 256- and 32-token chunk buckets, up to
8 rows a call). Tunix: `Sampler` with a KV cache of exactly prompt bucket + generated tokens,
`max_prompt_length` the prompt length (its power-of-two default for the multi-turn contexts),
`temperature=1, top_p=1`.

Model FLOP utilization: decode FLOPs per generated token = 2 * (weights of the layers + the LM
head matrix), attention scores excluded; MFU = tok/s * that / the machine's measured f32 matmul
GFLOP/s (a jitted 1024^3 matmul, timed at the start and the end of the run, median). The samplers'
tok/s include prefill, so this is a lower bound of the decode MFU.

Writes results/sampler_vs_tunix.json and .png (--out sets the stem; with --merge, workloads of
the existing JSON that this run does not measure are kept, each tagged with its run). The machine
may be shared: the JSON records the load average at the start and the end of the run and of each
workload; compare the interleaved ratios, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax.models.qwen3 import Qwen3, Qwen3Config
from trace_jax.sampling.engine import PromptRequest, SamplerConfig, SamplerEngine
from trace_jax.sampling.testing import IdTokenizer

VOCAB = 2048
FIRST_ID = 8  # prompt and observation ids start here (Tunix treats its pad id 0 as padding)
MODELS = {
    "l2_d128": Qwen3Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=32, tie_word_embeddings=True,
                           max_position_embeddings=4096, rope_theta=1_000_000.0),
    "l8_d512": Qwen3Config(vocab_size=VOCAB, hidden_size=512, intermediate_size=1536, num_layers=8,
                           num_heads=8, num_kv_heads=4, head_dim=64, tie_word_embeddings=True,
                           max_position_embeddings=4096, rope_theta=1_000_000.0),
}
TOK = IdTokenizer()


# ---- pure helpers --------------------------------------------------------------------------------
def matmul_params(cfg: Qwen3Config) -> int:
  """Weights a decode step multiplies by per token: every layer's projections (and norms) plus the
  LM head matrix (the tied embedding, or lm_head); the embedding lookup is not a matmul."""
  d, h, kv, hd, f = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                     cfg.intermediate_size)
  attn = d * h * hd + 2 * d * kv * hd + h * hd * d + 2 * hd
  mlp = 3 * d * f
  return cfg.num_layers * (attn + mlp + 2 * d) + d + d * cfg.vocab_size


def decode_flops_per_token(cfg: Qwen3Config) -> int:
  """2 * matmul_params: one multiply-add per weight per generated token."""
  return 2 * matmul_params(cfg)


def tree_plan(prompts: int, rollouts: int, turns: int, forks: int, turn_tokens: int,
              obs_tokens: int, prompt_len: int) -> dict:
  """Shapes of the multi-turn tree workload: generated tokens, and the Tunix batches (rows,
  context length) that replay it turn by turn (stage 1: `rollouts` per prompt for `turns` turns;
  then `forks` per rollout from its first turn, for turns 2..turns)."""
  ctx = [prompt_len + t * (turn_tokens + obs_tokens) for t in range(turns)]
  stage1 = [(prompts * rollouts, ctx[t]) for t in range(turns)]
  fork = [(prompts * rollouts * forks, ctx[t]) for t in range(1, turns)]
  batches = stage1 + fork
  return {"generated_tokens": sum(r for r, _ in batches) * turn_tokens, "tunix_batches": batches,
          "prefill_tokens_tunix": sum(r * c for r, c in batches)}


def summarize(ours: list[float], tunix: list[float]) -> dict:
  """Medians of the two samplers' tok/s samples and their ratio (ours / Tunix); also the median
  of the per-round ratios (round i: ours' call i and Tunix's call i, run back to back), which
  drifts less when the machine's load changes during the run."""
  mo, mt = float(np.median(ours)), float(np.median(tunix))
  pairs = [o / t for o, t in zip(ours, tunix)]
  return {"ours_tok_s": mo, "tunix_tok_s": mt, "ratio_ours_over_tunix": mo / mt,
          "round_ratios": pairs, "median_round_ratio": float(np.median(pairs))}


# ---- machine -------------------------------------------------------------------------------------
def matmul_gflops(n: int = 1024, reps: int = 5) -> float:
  """Median GFLOP/s of a jitted f32 [n, n] @ [n, n] (2 n^3 FLOPs)."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
  f = jax.jit(lambda x, y: x @ y)
  f(a, b).block_until_ready()
  ts = []
  for _ in range(reps):
    t = time.perf_counter()
    f(a, b).block_until_ready()
    ts.append(time.perf_counter() - t)
  return 2 * n ** 3 / float(np.median(ts)) / 1e9


# ---- Tunix side ----------------------------------------------------------------------------------
class TunixIdTokenizer:
  """Tunix's tokenizer interface over our id <-> "w{i}" words: no BOS, pad 0 (never in a prompt),
  EOS unused (the calls pass an EOS id that never occurs)."""

  def encode(self, text, **_):
    return TOK.encode(text)

  def decode(self, ids, **_):
    return TOK.decode(ids)

  def bos_id(self):
    return None

  def eos_id(self):
    return 1

  def pad_id(self):
    return 0


def tunix_model(cfg: Qwen3Config, ours: Qwen3):
  """Tunix's Qwen3 module of the same shapes, holding our model's weights."""
  from tunix.models.qwen3 import model as tq

  tcfg = tq.ModelConfig(num_layers=cfg.num_layers, vocab_size=cfg.vocab_size,
                        embed_dim=cfg.hidden_size, hidden_dim=cfg.intermediate_size,
                        num_heads=cfg.num_heads, head_dim=cfg.head_dim,
                        num_kv_heads=cfg.num_kv_heads, rope_theta=int(cfg.rope_theta),
                        norm_eps=cfg.rms_norm_eps, use_tied_embedding=cfg.tie_word_embeddings)
  t = tq.Qwen3(tcfg, rngs=nnx.Rngs(0))

  def put(dst, src):
    value, old = jnp.asarray(src[...]), dst[...]
    assert old.shape == value.shape, (old.shape, value.shape)
    dst.set_value(value.astype(old.dtype))

  put(t.embedder.input_embedding, ours.embed_tokens)
  for tl, ol in zip(t.layers, ours.layers):
    put(tl.input_layernorm.w, ol.input_layernorm.weight)
    put(tl.post_attention_layernorm.w, ol.post_attention_layernorm.weight)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
      put(getattr(tl.attn, name).w, getattr(ol.self_attn, name))
    put(tl.attn.q_norm.w, ol.self_attn.q_norm.weight)
    put(tl.attn.k_norm.w, ol.self_attn.k_norm.weight)
    for name in ("gate_proj", "up_proj", "down_proj"):
      put(getattr(tl.mlp, name).kernel, getattr(ol.mlp, name))
  put(t.final_norm.w, ours.norm.weight)
  if not cfg.tie_word_embeddings:
    put(t.lm_head.w, ours.lm_head)
  return t


def tunix_sampler(tmodel, cfg: Qwen3Config, cache_size: int):
  from tunix.generate import sampler as ts

  cache = ts.CacheConfig(cache_size=cache_size, num_layers=cfg.num_layers,
                         num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
  return ts.Sampler(transformer=tmodel, tokenizer=TunixIdTokenizer(), cache_config=cache)


def tunix_generate(sampler, contexts, gen: int, max_prompt_length=None, greedy=False, seed=0):
  """One Tunix call on token-id contexts: (generated id arrays, generated token count)."""
  kw = {} if greedy else {"temperature": 1.0, "top_p": 1.0}
  out = sampler([TOK.decode(c) for c in contexts], max_generation_steps=gen,
                max_prompt_length=max_prompt_length, eos_tokens=[-1], seed=seed, **kw)
  return out.tokens, int(sum(len(t) for t in out.tokens))


# ---- our side ------------------------------------------------------------------------------------
def _done(calls):
  return [(None, True, 0.0)] * len(calls)


def our_engine(graphdef, state, *, slots: int, max_seq_len: int, turn_tokens: int, turns: int,
               prefill_chunk, prefill_rows: int, decode_steps: int, greedy=False,
               env=_done, obs_tokens: int = 0, group: int = 8, tree_attention=True,
               page_buckets=()):
  """Our engine for one workload (`page_buckets` (): the engine's default, powers of two)."""
  ps = 16
  cfg = SamplerConfig(num_slots=slots, page_size=ps,
                      num_pages=slots * (-(-max_seq_len // ps) + 2) + 8, max_seq_len=max_seq_len,
                      max_turn_tokens=turn_tokens, max_obs_tokens=max(obs_tokens, 1),
                      max_turns=turns, prefill_chunk=tuple(np.atleast_1d(prefill_chunk).tolist()),
                      prefill_batch=prefill_rows, temperature=1.0, top_p=1.0, greedy=greedy,
                      use_tree_attention=tree_attention, max_group_size=min(group, slots),
                      leaf_features=False, decode_steps=decode_steps,
                      page_buckets=page_buckets)
  return SamplerEngine(graphdef, state, cfg, TOK.encode, TOK.decode, env, eos_id=None,
                       stop_strings=())


def instrument(engine) -> dict:
  """Wraps the engine's jitted steps to accumulate their wall time (each waits for its result;
  the engine reads every decode call's result right away, so this adds little). The caller
  zeroes the dict's values per call; the rest of a call's wall time is host work."""
  acc = {"decode_s": 0.0, "decode_calls": 0, "prefill_s": 0.0, "prefill_calls": 0,
         "copy_s": 0.0}

  def wrap(fn, key, calls=None):
    def timed(*a):
      t = time.perf_counter()
      out = jax.block_until_ready(fn(*a))
      acc[key] += time.perf_counter() - t
      if calls:
        acc[calls] += 1
      return out
    return timed

  engine._decode = wrap(engine._decode, "decode_s", "decode_calls")
  engine._prefill = wrap(engine._prefill, "prefill_s", "prefill_calls")
  engine._copy = wrap(engine._copy, "copy_s")
  return acc


def _timed_run(engine, acc, fn):
  """Runs fn() on the engine: (generated tokens, wall s, breakdown of the wall time)."""
  for k in acc:
    acc[k] = type(acc[k])(0)
  g0, t0 = engine.ledger.generated_tokens, time.perf_counter()
  fn()
  wall = time.perf_counter() - t0
  engine.release()
  parts = dict(acc)
  parts["host_s"] = wall - acc["decode_s"] - acc["prefill_s"] - acc["copy_s"]
  return engine.ledger.generated_tokens - g0, wall, parts


def observation(gen_ids, depth: int, n: int) -> list[int]:
  """The tree workload's deterministic observation after a turn (depends on the turn's tokens)."""
  h = int(sum(int(t) for t in gen_ids)) + 7 * depth
  return [FIRST_ID + (h + 3 * k) % (VOCAB - FIRST_ID) for k in range(n)]


class TreeEnv:
  """Ends a rollout after `turns` turns; otherwise returns `observation(...)` as text."""

  def __init__(self, turns: int, obs_tokens: int):
    self.turns, self.obs_tokens = turns, obs_tokens

  def __call__(self, calls):
    out = []
    for ref, _ in calls:
      d = ref.node.depth
      if d >= self.turns:
        out.append((None, True, 0.0))
      else:
        out.append((TOK.decode(observation(ref.node.gen_ids, d, self.obs_tokens)), False, 0.0))
    return out


# ---- sanity check --------------------------------------------------------------------------------
def sanity(name, cfg, model, tmodel, graphdef, state, decode_steps):
  """Logits of both modules on the same prompts; greedy tokens of both samplers."""
  rng = np.random.default_rng(123)
  prompts = rng.integers(FIRST_ID, VOCAB, (4, 64)).astype(np.int32)
  ours_logits = np.asarray(model(jnp.asarray(prompts)))
  pos = jnp.broadcast_to(jnp.arange(64, dtype=jnp.int32), (4, 64))
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((64, 64), bool)), (4, 64, 64))
  t_logits, _ = tmodel(jnp.asarray(prompts), pos, None, mask)
  t_logits = np.asarray(t_logits)
  gen = 16
  engine = our_engine(graphdef, state, slots=4, max_seq_len=64 + gen + 16, turn_tokens=gen,
                      turns=1, prefill_chunk=64, prefill_rows=4, decode_steps=decode_steps,
                      greedy=True)
  trees = engine.run([PromptRequest(list(p), n=1) for p in prompts])
  ours_tok = np.asarray([t.leaves()[0].gen_ids for t in trees])
  engine.release()
  sampler = tunix_sampler(tmodel, cfg, 64 + gen)
  t_tok, _ = tunix_generate(sampler, prompts, gen, max_prompt_length=64, greedy=True)
  t_tok = np.asarray([np.asarray(t)[:gen] for t in t_tok])
  first_diff = [int(np.argmax(a != b)) if (a != b).any() else gen for a, b in zip(ours_tok, t_tok)]
  out = {"logits_max_abs_diff": float(np.abs(ours_logits - t_logits).max()),
         "logits_max_abs": float(np.abs(ours_logits).max()),
         "argmax_agreement": float((ours_logits.argmax(-1) == t_logits.argmax(-1)).mean()),
         "greedy_steps": gen,
         "greedy_token_agreement": float((ours_tok == t_tok).mean()),
         "greedy_first_divergence_per_row": first_diff}
  print(f"[sanity] {name}: logits max |diff| {out['logits_max_abs_diff']:.2e} "
        f"(max |logit| {out['logits_max_abs']:.2e}), argmax agree {out['argmax_agreement']:.3f}; "
        f"greedy tokens agree {out['greedy_token_agreement']:.3f}, first divergence {first_diff}",
        flush=True)
  return out


# ---- workloads -----------------------------------------------------------------------------------
def plain_workload(graphdef, state, cfg, tmodel, *, rows, prompt_len, gen, group, decode_steps,
                   tree_attention=True):
  """rows // group prompts, each sampled `group` times (group 1: a plain batch). Returns
  (ours_call, tunix_call, meta); a call returns (generated tokens, wall seconds)."""
  prompts = rows // group
  engine = our_engine(graphdef, state, slots=rows, max_seq_len=prompt_len + gen + 16,
                      turn_tokens=gen, turns=1, prefill_chunk=prompt_len,
                      prefill_rows=prompts, decode_steps=decode_steps, group=group,
                      tree_attention=tree_attention)
  acc = instrument(engine)
  sampler = tunix_sampler(tmodel, cfg, prompt_len + gen)
  seeds = iter(range(10 ** 6))

  def make_prompts():
    rng = np.random.default_rng(next(seeds))
    return [list(rng.integers(FIRST_ID, VOCAB, prompt_len)) for _ in range(prompts)]

  def ours():
    reqs = [PromptRequest(p, n=group) for p in make_prompts()]
    return _timed_run(engine, acc, lambda: engine.run(reqs))

  def tunix():
    ctx = [p for p in make_prompts() for _ in range(group)]
    t0 = time.perf_counter()
    _, n = tunix_generate(sampler, ctx, gen, max_prompt_length=prompt_len, seed=next(seeds))
    return n, time.perf_counter() - t0, {}

  meta = {"rows": rows, "prompts": prompts, "samples_per_prompt": group,
          "prompt_tokens": prompt_len,
          "generated_per_row": gen, "tunix_cache_size": prompt_len + gen,
          "ours": {"num_slots": rows, "decode_steps": engine.cfg.decode_steps, "page_size": 16,
                   "tree_attention": tree_attention, "prefill_chunk": prompt_len,
                   "prefill_batch": prompts, "leaf_features": False}}
  return ours, tunix, meta


def tree_workload(graphdef, state, cfg, tmodel, *, prompts, rollouts, turns, forks, turn_tokens,
                  obs_tokens, prompt_len, decode_steps, tree_attention=True):
  plan = tree_plan(prompts, rollouts, turns, forks, turn_tokens, obs_tokens, prompt_len)
  max_ctx = max(c for _, c in plan["tunix_batches"])
  slots = prompts * rollouts * forks
  # Observation prefills (a turn's pending token + the observation) in a small chunk bucket, the
  # observations of a stage-1 turn in one call.
  obs_bucket = 1 << obs_tokens.bit_length()
  prefill_rows = prompts * rollouts
  engine = our_engine(graphdef, state, slots=slots,
                      max_seq_len=prompt_len + turns * (turn_tokens + obs_tokens) + 16,
                      turn_tokens=turn_tokens, turns=turns,
                      prefill_chunk=(obs_bucket, prompt_len), prefill_rows=prefill_rows,
                      decode_steps=decode_steps,
                      env=TreeEnv(turns, obs_tokens), obs_tokens=obs_tokens,
                      group=max(rollouts, forks), tree_attention=tree_attention)
  acc = instrument(engine)
  bucket = 1 << (max_ctx - 1).bit_length()  # Tunix pads prompts to a power of two by default
  sampler = tunix_sampler(tmodel, cfg, bucket + turn_tokens)
  seeds = iter(range(10 ** 6))

  def make_prompts():
    rng = np.random.default_rng(next(seeds))
    return [list(rng.integers(FIRST_ID, VOCAB, prompt_len)) for _ in range(prompts)]

  def ours():
    ps = make_prompts()

    def both_stages():
      trees = engine.run([PromptRequest(p, n=rollouts) for p in ps])
      engine.run([(t, n.id, forks) for t in trees for n in t.nodes if n.depth == 1])

    return _timed_run(engine, acc, both_stages)

  def run_turns(contexts, first_depth, seed):
    """Turns first_depth..turns of every context; returns (contexts after turn first_depth with
    its observation, generated tokens)."""
    total, after_first = 0, None
    for depth in range(first_depth, turns + 1):
      out, n = tunix_generate(sampler, contexts, turn_tokens, seed=seed + depth)
      total += n
      nxt = []
      for c, g in zip(contexts, out):
        g = [int(x) for x in g]
        nxt.append(c + g + (observation(g, depth, obs_tokens) if depth < turns else []))
      contexts = nxt
      if depth == first_depth:
        after_first = contexts
    return after_first, total

  def tunix():
    ps = make_prompts()
    seed = next(seeds) * 100
    t0 = time.perf_counter()
    first, n1 = run_turns([p for p in ps for _ in range(rollouts)], 1, seed)
    _, n2 = run_turns([c for c in first for _ in range(forks)], 2, seed + 50)
    return n1 + n2, time.perf_counter() - t0, {}

  meta = {"prompts": prompts, "rollouts_per_prompt": rollouts, "turns": turns,
          "forks_per_rollout_from_turn_1": forks, "turn_tokens": turn_tokens,
          "observation_tokens": obs_tokens, "prompt_tokens": prompt_len,
          "generated_tokens_per_call": plan["generated_tokens"],
          "tunix_batches_rows_ctx": plan["tunix_batches"],
          "tunix_prefill_tokens_unpadded": plan["prefill_tokens_tunix"],
          "tunix_cache_size": bucket + turn_tokens,
          "ours": {"num_slots": slots, "decode_steps": engine.cfg.decode_steps, "page_size": 16,
                   "tree_attention": tree_attention,
                   "prefill_chunk": [obs_bucket, prompt_len], "prefill_batch": prefill_rows,
                   "leaf_features": False}}
  return ours, tunix, meta


def interleave(name, ours, tunix, reps, flops_tok, gflops):
  """First call of each compiles; then `reps` rounds of (ours, Tunix)."""
  samples = {"ours": [], "tunix": []}
  first, parts = {}, []
  load0 = os.getloadavg()
  for r in range(reps + 1):
    for who, fn in (("ours", ours), ("tunix", tunix)):
      n, wall, extra = fn()
      if r == 0:
        first[who] = {"wall_s": wall, "tokens": n}
      else:
        samples[who].append(n / wall)
        if extra:
          parts.append(extra)
  res = summarize(samples["ours"], samples["tunix"])
  res["samples_tok_s"] = samples
  res["load_avg_start"], res["load_avg_end"] = load0, os.getloadavg()
  # Where our timed calls spend their wall time (medians over the calls).
  res["ours_breakdown_s"] = {k: float(np.median([p[k] for p in parts])) for k in parts[0]}
  for who in ("ours", "tunix"):
    med_wall = first[who]["tokens"] / res[f"{who}_tok_s"]
    res[f"{who}_first_call_s"] = first[who]["wall_s"]
    res[f"{who}_compile_s_est"] = max(0.0, first[who]["wall_s"] - med_wall)
    res[f"{who}_mfu"] = res[f"{who}_tok_s"] * flops_tok / (gflops * 1e9)  # updated at the end
  res["generated_tokens_per_call"] = first["ours"]["tokens"]
  assert first["ours"]["tokens"] == first["tunix"]["tokens"], first
  print(f"[{name}] ours {res['ours_tok_s']:9.1f} tok/s, Tunix {res['tunix_tok_s']:9.1f} tok/s, "
        f"ratio x{res['ratio_ours_over_tunix']:.2f}  (compile ~{res['ours_compile_s_est']:.1f}s "
        f"vs ~{res['tunix_compile_s_est']:.1f}s; MFU {res['ours_mfu']:.3f} vs "
        f"{res['tunix_mfu']:.3f}); ours: "
        + ", ".join(f"{k} {v:.2f}" for k, v in res["ours_breakdown_s"].items()), flush=True)
  return res


def plot(result, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  names = list(result["workloads"])
  fig, ax = plt.subplots(1, 2, figsize=(13, 4.2))
  x = np.arange(len(names))
  w = result["workloads"]
  ax[0].bar(x - 0.2, [w[n]["ours_tok_s"] for n in names], 0.4, label="ours (SamplerEngine)")
  ax[0].bar(x + 0.2, [w[n]["tunix_tok_s"] for n in names], 0.4, label="Tunix Sampler")
  ax[0].set_yscale("log")
  ax[0].set_ylabel("generated tok/s (median)")
  ax[0].set_title("throughput (shared CPU, absolute numbers indicative)", fontsize=10)
  ax[0].legend(fontsize=8)
  ratios = [w[n]["ratio_ours_over_tunix"] for n in names]
  ax[1].bar(x, ratios, color=["tab:green" if r >= 1 else "tab:red" for r in ratios])
  ax[1].axhline(1.0, color="k", lw=0.8)
  for i, r in enumerate(ratios):
    ax[1].text(i, r, f"x{r:.2f}", ha="center", va="bottom", fontsize=8)
  ax[1].set_ylabel("ours / Tunix (interleaved medians)")
  ax[1].set_title("throughput ratio", fontsize=10)
  for a in ax:
    a.set_xticks(x)
    a.set_xticklabels(names, fontsize=8, rotation=15)
    a.grid(alpha=0.3, axis="y")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true", help="small batches, 1 timed rep: a smoke run")
  ap.add_argument("--out", default="results/sampler_vs_tunix")
  ap.add_argument("--reps", type=int, default=None, help="timed calls per sampler (default 4)")
  ap.add_argument("--decode-steps", type=int, default=None,
                  help="our engine's decode steps per device call (default: the turn length)")
  ap.add_argument("--workloads", default="plain,grpo,tree",
                  help="comma-separated subset of plain, grpo, tree")
  ap.add_argument("--models", default="l2_d128,l8_d512")
  ap.add_argument("--plain-rows", default="l2_d128:32,l8_d512:16",
                  help="rows of the plain batch per model (model:rows,...)")
  ap.add_argument("--grpo-prompts", type=int, default=2, help="prompts of 8 samples each")
  ap.add_argument("--tree-models", default="l2_d128",
                  help="models that run the multi-turn tree workload (it re-prefills every "
                       "context on the Tunix side: minutes per call on the larger model here)")
  ap.add_argument("--merge", action="store_true",
                  help="keep the workloads of an existing --out JSON that this run does not "
                       "measure (each workload records the run it comes from)")
  ap.add_argument("--attention", choices=("tree", "plain"), default="tree",
                  help="our engine's decode attention (tree: shared pages read once per group)")
  args = ap.parse_args()
  from importlib.metadata import version

  import tunix  # noqa: F401  (fail early, before any work, when the venv lacks it)

  t_start = time.perf_counter()
  reps = args.reps or (1 if args.quick else 4)
  plain_rows = {k: int(v) for k, v in (x.split(":") for x in args.plain_rows.split(","))}
  grpo_prompts = 1 if args.quick else args.grpo_prompts
  gen = 32 if args.quick else 128
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  load0 = os.getloadavg()
  gflops0 = matmul_gflops()
  print(f"[machine] f32 1024^3 matmul: {gflops0:.1f} GFLOP/s, load {load0}", flush=True)
  result = {
      "note": "CPU run on a shared machine (other jobs running): absolute tok/s and MFU are "
              "indicative only; the two samplers alternate call by call, so compare the ratios.",
      "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                  "backend": jax.default_backend(), "jax": jax.__version__,
                  "jaxlib": version("jaxlib"), "flax": version("flax"),
                  "tunix": version("google-tunix"), "tunix_jax": jax.__version__,
                  "load_avg_start": load0},
      "settings": {"quick": args.quick, "reps": reps, "sampling": "temperature 1, no top-p/top-k",
                   "mfu_formula": "tok/s * 2 * matmul_params / measured f32 matmul FLOP/s; "
                                  "matmul_params = layer weights + LM head (embedding lookup and "
                                  "attention scores excluded); tok/s includes prefill",
                   "compile_s_est": "first call wall - median timed call wall"},
      "sanity": {}, "workloads": {}}
  workloads = args.workloads.split(",")

  run_id = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
  result["machine"]["run"] = run_id
  kept = {"workloads": {}, "sanity": {}, "runs": [], "superseded": []}
  if args.merge and os.path.exists(args.out + ".json"):
    with open(args.out + ".json") as f:
      old = json.load(f)
    kept = {"workloads": old["workloads"], "sanity": old["sanity"],
            "runs": old.get("earlier_runs", []) + [old["machine"]],
            "superseded": old.get("superseded", [])}
    for w in kept["workloads"].values():  # summaries of older runs, recomputed from their samples
      w.update(summarize(w["samples_tok_s"]["ours"], w["samples_tok_s"]["tunix"]))

  def save():  # after every workload, so a cut run keeps what it measured
    result["wall_s"] = time.perf_counter() - t_start
    out = dict(result, workloads={**kept["workloads"], **result["workloads"]},
               sanity={**kept["sanity"], **result["sanity"]})
    if kept["runs"]:
      out["earlier_runs"] = kept["runs"]
    # Workloads this run measured again: the earlier measurements stay in the file.
    out["superseded"] = kept["superseded"] + [dict(v, name=k) for k, v in kept["workloads"].items()
                                              if k in result["workloads"]]
    with open(args.out + ".json", "w") as f:
      json.dump(out, f, indent=1)
    return out

  models = args.models.split(",")
  for mname in models:
    cfg = MODELS[mname]
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tmodel = tunix_model(cfg, model)
    flops_tok = decode_flops_per_token(cfg)
    result["machine"][f"decode_flops_per_token_{mname}"] = flops_tok
    result["sanity"][mname] = sanity(mname, cfg, model, tmodel, graphdef, state,
                                     args.decode_steps or 16)
    if "plain" in workloads:
      o, t, meta = plain_workload(graphdef, state, cfg, tmodel,
                                  rows=8 if args.quick else plain_rows[mname], prompt_len=64,
                                  gen=gen, group=1, decode_steps=args.decode_steps or gen,
                                  tree_attention=args.attention == "tree")
      res = interleave(f"plain_{mname}", o, t, reps, flops_tok, gflops0)
      result["workloads"][f"plain_{mname}"] = {"model": mname, "run": run_id, "workload": meta,
                                               **res}
      save()
    if "grpo" in workloads:
      o, t, meta = plain_workload(graphdef, state, cfg, tmodel, rows=8 * grpo_prompts,
                                  prompt_len=128 if args.quick else 512, gen=gen, group=8,
                                  decode_steps=args.decode_steps or gen,
                                  tree_attention=args.attention == "tree")
      res = interleave(f"grpo_{mname}", o, t, reps, flops_tok, gflops0)
      result["workloads"][f"grpo_{mname}"] = {"model": mname, "run": run_id, "workload": meta,
                                              **res}
      save()
    if "tree" in workloads and mname in args.tree_models.split(","):
      tt = 16 if args.quick else 32
      o, t, meta = tree_workload(graphdef, state, cfg, tmodel, prompts=1 if args.quick else 2,
                                 rollouts=4, turns=3, forks=2, turn_tokens=tt,
                                 obs_tokens=12 if args.quick else 24,
                                 prompt_len=64 if args.quick else 256,
                                 decode_steps=args.decode_steps or tt,
                                 tree_attention=args.attention == "tree")
      res = interleave(f"tree_{mname}", o, t, reps, flops_tok, gflops0)
      result["workloads"][f"tree_{mname}"] = {"model": mname, "run": run_id, "workload": meta,
                                              **res}
      save()
  gflops1 = matmul_gflops()
  gflops = float(np.median([gflops0, gflops1]))
  result["machine"].update({"matmul_gflops_start": gflops0, "matmul_gflops_end": gflops1,
                            "matmul_gflops_used": gflops, "load_avg_end": os.getloadavg()})
  for w in result["workloads"].values():  # MFU against this run's median matmul rate
    flops_tok = result["machine"][f"decode_flops_per_token_{w['model']}"]
    for who in ("ours", "tunix"):
      w[f"{who}_mfu"] = w[f"{who}_tok_s"] * flops_tok / (gflops * 1e9)
    w["mfu_matmul_gflops"] = gflops
  print(f"[machine] f32 matmul at the end: {gflops1:.1f} GFLOP/s, load {os.getloadavg()}")
  result["targets"] = {"plain_l8_d512": 1.0, "plain_l2_d128": 1.2, "grpo": 2.0,
                       "note": "issue targets for ours / Tunix; reported as measured"}
  plot(save(), args.out + ".png")
  print(f"wrote {args.out}.json and .png in {result['wall_s']:.0f}s")


if __name__ == "__main__":
  main()
