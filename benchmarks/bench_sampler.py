"""Sampler benchmark on CPU: tree sharing vs duplicated prefixes, task affinity vs synchronous.

Writes results/sampler_cpu.json and results/sampler_cpu.png.

1. Decode throughput and KV memory, for B branches forked from one prefix of L tokens: `tree` (the
   branches share the prefix pages, tree attention reads them once per group) vs `dup` (every
   branch holds its own copy of the prefix pages and attends with plain paged attention), plus
   `shared_plain` (shared pages, plain attention: the memory saving without the kernel). Each
   measurement generates `gen` tokens per branch; reps of the modes are interleaved and the
   median step time is reported. KV memory counts the pages the branches hold (for `tree`, the
   shared prefix once; for `dup`, B copies).
2. Slot utilization on a long-tailed simulated workload (Pareto turn counts and turn lengths):
   task-affine workers (continuous refill, W = 4 and W = 1) vs synchronous turns (a new batch
   when the previous one is done, or refilling free slots at each turn barrier).
3. End-to-end generated tokens/s of the engine for the tiny model with 32 slots (a trainer-like
   workload: prompts of 60 tokens, 8 rollouts each, 3 turns with 40-token turns and observations).

Usage: python benchmarks/bench_sampler.py [--quick] [--out results/sampler_cpu]
       python benchmarks/bench_sampler.py --throughput [--decode-steps K] [--reps N]
         (section 3 alone, stop tags on; with PYTHONPATH on another checkout, its engine)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time

import jax
import numpy as np
from flax import nnx

from trace_jax.models.qwen3 import Qwen3, Qwen3Config, get_preset
from trace_jax.sampling.paged_kv import pool_bytes
from trace_jax.sampling.engine import PromptRequest, SamplerConfig, SamplerEngine
from trace_jax.sampling.scheduler import run_synchronous, run_task_affine
from trace_jax.sampling.testing import IdTokenizer, LongTailEnv, ScriptedEnv

VOCAB = 2048
MODELS = {
    "tiny": get_preset("tiny", vocab_size=VOCAB, max_position_embeddings=8192),
    "d512_l8": Qwen3Config(vocab_size=VOCAB, hidden_size=512, intermediate_size=1536, num_layers=8,
                           num_heads=8, num_kv_heads=4, head_dim=64, tie_word_embeddings=True,
                           max_position_embeddings=8192, rope_theta=10_000.0),
}
MODES = {"tree": dict(use_tree_attention=True, share_prefix=True),
         "shared_plain": dict(use_tree_attention=False, share_prefix=True),
         "dup": dict(use_tree_attention=False, share_prefix=False)}
TOK = IdTokenizer()


def _done_env(calls):
  return [(None, True, 0.0)] * len(calls)


def _one_step():
  """One decode step per device call (the sharing case times single steps); {} for an engine
  from before multi-step calls."""
  return {"decode_steps": 1} if "decode_steps" in SamplerConfig.__dataclass_fields__ else {}


def _timed_decode(engine):
  """Wraps the engine's decode step to record the wall time of each step."""
  times, step = [], engine._decode

  def timed(*args):
    t = time.perf_counter()
    out = jax.block_until_ready(step(*args))
    times.append(time.perf_counter() - t)
    return out

  engine._decode = timed
  return times


def sharing_case(graphdef, state, prefix: int, branches: int, gen: int, reps: int, modes):
  """One (model, prefix, branches) point: the modes interleaved over reps, median step time."""
  ps = 16
  prefix_pages = -(-prefix // ps)
  cfg = SamplerConfig(num_slots=branches, page_size=ps,
                      num_pages=branches * (prefix_pages + 4) + prefix_pages + 8,
                      max_seq_len=prefix + gen + 2 * ps, max_turn_tokens=gen, max_turns=1,
                      prefill_chunk=(256,), prefill_batch=1, max_group_size=branches,
                      max_groups=1, page_buckets=(2, 16), leaf_features=False, **_one_step())
  engine = SamplerEngine(graphdef, state, dataclasses.replace(cfg, max_turn_tokens=1),
                         TOK.encode, TOK.decode, _done_env, eos_id=None, stop_strings=())
  times = _timed_decode(engine)
  rng = np.random.default_rng(prefix)
  tree = engine.run([PromptRequest(list(rng.integers(8, VOCAB, prefix + 1)), n=1)])[0]
  root_pages = len(engine.tree_state(tree).page_refs[0])  # the prompt's pages
  page_bytes = pool_bytes(engine.pool) // cfg.num_pages
  mark = engine.checkpoint(tree)
  base_used = engine.alloc.capacity - engine.alloc.num_free
  rows = {m: {"step_s": [], "kv_bytes": 0} for m in modes}
  for rep in range(reps + 1):  # rep 0 compiles each mode (one token per branch)
    for mode in modes:
      flags = MODES[mode]
      engine.cfg = dataclasses.replace(cfg, max_turn_tokens=gen if rep else 1, **flags)
      times.clear()
      engine.run([(tree, 0, branches)])
      if rep:
        rows[mode]["step_s"] += times
      used = engine.alloc.capacity - engine.alloc.num_free - base_used
      # Pages the branches need: their own, plus the prefix once when it is shared.
      rows[mode]["kv_bytes"] = (used + (root_pages if flags["share_prefix"] else 0)) * page_bytes
      engine.rollback(tree, mark)
  engine.release()
  out = {"prefix": prefix, "branches": branches, "gen_tokens": gen, "reps": reps}
  for mode, r in rows.items():
    out[f"{mode}_tok_s"] = float(branches / np.median(r["step_s"]))
    out[f"{mode}_kv_bytes"] = int(r["kv_bytes"])
  out["speedup_tree_vs_dup"] = out["tree_tok_s"] / out["dup_tok_s"]
  out["kv_ratio_dup_vs_tree"] = out["dup_kv_bytes"] / out["tree_kv_bytes"]
  return out


def utilization_bench(graphdef, state, quick: bool):
  """Long-tailed workload through the real engine (tiny model), three scheduling modes."""
  prompts = 24 if quick else 192

  def turn_limit(tree, rollout, depth):  # Pareto turn lengths, deterministic per turn
    rng = np.random.default_rng([tree.uid, rollout, depth, 7])
    return int(6 + rng.pareto(2.0) * 6)

  cfg = SamplerConfig(num_slots=32, page_size=16, num_pages=16384, max_seq_len=512,
                      max_turn_tokens=64, max_obs_tokens=16, max_turns=8, prefill_chunk=(32,),
                      prefill_batch=8, use_tree_attention=False, leaf_features=False)
  rng = np.random.default_rng(0)
  reqs = [PromptRequest(list(rng.integers(8, VOCAB, 40)), n=8) for _ in range(prompts)]
  out = {"workload": {"prompts": prompts, "rollouts_per_prompt": 8, "num_slots": 32,
                      "turn_tokens": "6 + 6 * Pareto(2), capped at 64",
                      "turns": "1 + Pareto(2), capped at 6", "attention": "plain paged"}}
  series = {}
  for name, fn in [("task_affine_w4", lambda e: run_task_affine(e, reqs, 4)),
                   ("task_affine_w1", lambda e: run_task_affine(e, reqs, 1)),
                   ("synchronous_refill", lambda e: run_synchronous(e, reqs, refill=True)),
                   ("synchronous", lambda e: run_synchronous(e, reqs))]:
    engine = SamplerEngine(graphdef, state, cfg, TOK.encode, TOK.decode,
                           LongTailEnv(VOCAB, seed=0, mean_turns=1.0, max_turns=6, shape=2.0),
                           eos_id=None, stop_strings=(), turn_limit_fn=turn_limit,
                           record_steps=1 << 20)  # every decode step of one run (it refuses more)
    _, report = fn(engine)  # the step log then holds this run's steps alone
    out[name] = report.as_dict()
    series[name] = [int(x.sum()) for x in engine.step_log]
    engine.release()
  return out, series


def engine_throughput(graphdef, state, quick: bool):
  """End-to-end generated tokens/s, tiny model, 32 slots, trainer-like turns."""
  res = {}
  for name, tree_attn in (("tree_attention", True), ("plain_attention", False)):
    cfg = SamplerConfig(num_slots=32, page_size=16, num_pages=8192, max_seq_len=512,
                        max_turn_tokens=40, max_obs_tokens=64, max_turns=4,
                        prefill_chunk=(32, 128), prefill_batch=8, use_tree_attention=tree_attn)
    engine = SamplerEngine(graphdef, state, cfg, TOK.encode, TOK.decode,
                           ScriptedEnv(VOCAB, max_depth=3, obs_growth=20), eos_id=1)
    rng = np.random.default_rng(0)
    runs = []
    for i in range(2 if quick else 3):
      reqs = [PromptRequest(list(rng.integers(8, VOCAB, 60)), n=8) for _ in range(8)]
      g0, t0 = engine.ledger.generated_tokens, time.perf_counter()
      engine.run(reqs)
      if i:  # the first run compiles
        runs.append((engine.ledger.generated_tokens - g0) / (time.perf_counter() - t0))
      engine.release()
    res[name] = {"generated_tok_s": float(np.median(runs)), "runs": runs,
                 "slot_utilization": engine.ledger.busy_slot_steps
                 / engine.ledger.total_slot_steps}
  return res


def throughput_only(decode_steps: int | None, reps: int, prompts: int = 8):
  """Generated tokens/s of the engine alone (tiny model, 32 slots, trainer-like turns, tree
  attention), `prompts` prompts of 8 rollouts per run: one warm-up run, then `reps` timed runs.
  decode_steps None: the engine's default
  (or an engine from before multi-step calls, run from another checkout)."""
  graphdef, state = nnx.split(Qwen3(MODELS["tiny"], rngs=nnx.Rngs(0)))
  kw = {} if decode_steps is None else {"decode_steps": decode_steps}
  # One page-table bucket and one chunk size: few compilations, so a loaded machine measures
  # the steady state quickly.
  cfg = SamplerConfig(num_slots=32, page_size=16, num_pages=4096, max_seq_len=256,
                      max_turn_tokens=32, max_obs_tokens=32, max_turns=4, page_buckets=(16,),
                      prefill_chunk=(64,), prefill_batch=8, **kw)
  stops = {5: "</search>", 6: "</answer>"}
  tok = IdTokenizer(stops)
  engine = SamplerEngine(graphdef, state, cfg, tok.encode, tok.decode,
                         ScriptedEnv(VOCAB, max_depth=3, obs_growth=8), eos_id=1)
  rng = np.random.default_rng(0)
  runs = []
  for i in range(reps + 1):
    reqs = [PromptRequest(list(rng.integers(8, VOCAB, 60)), n=8) for _ in range(prompts)]
    g0, t0 = engine.ledger.generated_tokens, time.perf_counter()
    engine.run(reqs)
    if i:  # the first run compiles
      runs.append((engine.ledger.generated_tokens - g0) / (time.perf_counter() - t0))
    engine.release()
  return {"decode_steps": getattr(cfg, "decode_steps", 1), "generated_tok_s": runs,
          "generated_tokens": engine.ledger.generated_tokens,
          "slot_utilization": engine.ledger.busy_slot_steps / engine.ledger.total_slot_steps}


def plot(result, series, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(1, 4, figsize=(20, 4.2))
  for model, rows in result["sharing"].items():
    for b in sorted({r["branches"] for r in rows}):
      sel = sorted((r for r in rows if r["branches"] == b), key=lambda r: r["prefix"])
      x = [r["prefix"] for r in sel]
      style = "-o" if model == "tiny" else "--s"
      ax[0].plot(x, [r["speedup_tree_vs_dup"] for r in sel], style, label=f"{model}, {b} br")
      ax[1].plot(x, [r["kv_ratio_dup_vs_tree"] for r in sel], style, label=f"{model}, {b} br")
  for a, title in ((ax[0], "decode speedup, tree / duplicated prefix"),
                   (ax[1], "KV memory, duplicated / tree")):
    a.set_xscale("log", base=2)
    a.set_yscale("log", base=2)
    a.set_xlabel("prefix tokens")
    a.set_title(title, fontsize=10)
    a.legend(fontsize=7)
    a.grid(alpha=0.3)
  util = result["utilization"]
  names = [n for n in util if n != "workload"]
  colors = ["tab:green", "tab:blue", "tab:orange", "tab:red"]
  ax[2].bar([n.replace("_", "\n", 1) for n in names], [util[n]["utilization"] for n in names],
            color=colors[:len(names)])
  ax[2].axhline(0.9, color="k", lw=0.8, ls=":")
  ax[2].set_ylim(0, 1)
  ax[2].set_title("slot utilization (long-tailed workload)", fontsize=10)
  for n, c in reversed(list(zip(names, colors))):  # synchronous first, the others on top
    busy = np.asarray(series[n], np.float64) / 32
    w = min(50, len(busy))
    ax[3].plot(np.convolve(busy, np.ones(w) / w, mode="valid"), color=c, lw=1.2, label=n)
  ax[3].set_xscale("log")
  ax[3].set_ylim(0, 1.02)
  ax[3].set_xlabel("decode step")
  ax[3].set_ylabel("busy slots / 32 (moving mean, 50 steps)")
  ax[3].set_title("busy slots over the run", fontsize=10)
  ax[3].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true", help="a small grid, for a smoke run")
  ap.add_argument("--out", default="results/sampler_cpu")
  ap.add_argument("--throughput", action="store_true",
                  help="only the engine's generated tokens/s (one JSON line); runs against any "
                       "checkout on PYTHONPATH, for before/after comparisons")
  ap.add_argument("--decode-steps", type=int, default=None)
  ap.add_argument("--reps", type=int, default=2)
  ap.add_argument("--prompts", type=int, default=8, help="--throughput: prompts per run")
  args = ap.parse_args()
  if args.throughput:
    print(json.dumps(throughput_only(args.decode_steps, args.reps, args.prompts)), flush=True)
    return
  t_start = time.perf_counter()
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  grids = {  # The larger model runs fewer points, for time (its 4k prefill alone takes ~10 s)
      # and memory (64 duplicated 4k prefixes would need ~4 GB of KV): no 64 branches, and 4k
      # only at 16 branches.
      "tiny": [(p, b) for p in (256, 1024, 4096) for b in (4, 16, 64)],
      "d512_l8": [(256, 4), (256, 16), (1024, 4), (1024, 16), (4096, 16)],
  }
  gen = {"tiny": 12, "d512_l8": 6}
  # shared_plain isolates the memory saving from the kernel; skipped on the slow model for time.
  modes = {"tiny": ("tree", "shared_plain", "dup"), "d512_l8": ("tree", "dup")}
  if args.quick:
    grids = {"tiny": [(256, 4), (1024, 16)], "d512_l8": [(256, 4)]}
  result = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                        "jax": jax.__version__, "backend": jax.default_backend()},
            "sharing": {}}
  for name, grid in grids.items():
    graphdef, state = nnx.split(Qwen3(MODELS[name], rngs=nnx.Rngs(0)))
    rows = []
    for prefix, branches in grid:
      t0 = time.perf_counter()
      row = sharing_case(graphdef, state, prefix, branches, gen[name], 2, modes[name])
      row["model"] = name
      rows.append(row)
      print(f"[sharing] {name:8s} prefix {prefix:5d} x {branches:2d}: tree "
            f"{row['tree_tok_s']:8.0f} tok/s, shared_plain "
            f"{row.get('shared_plain_tok_s', 0):8.0f}, dup "
            f"{row['dup_tok_s']:8.0f} (x{row['speedup_tree_vs_dup']:.2f}); KV "
            f"{row['tree_kv_bytes'] / 2**20:7.1f} MiB vs {row['dup_kv_bytes'] / 2**20:7.1f} MiB "
            f"(x{row['kv_ratio_dup_vs_tree']:.1f})  [{time.perf_counter() - t0:.0f}s]", flush=True)
    result["sharing"][name] = rows
  graphdef, state = nnx.split(Qwen3(MODELS["tiny"], rngs=nnx.Rngs(0)))
  result["utilization"], series = utilization_bench(graphdef, state, args.quick)
  for n, r in result["utilization"].items():
    if n != "workload":
      print(f"[utilization] {n:15s} {r['utilization']:.3f} over {r['decode_steps']} steps, "
            f"tail {r['tail_steps']} steps, {r['generated_tokens']} tokens", flush=True)
  result["engine_tokens_per_s"] = engine_throughput(graphdef, state, args.quick)
  for n, r in result["engine_tokens_per_s"].items():
    print(f"[engine] tiny, 32 slots, {n}: {r['generated_tok_s']:.0f} generated tok/s", flush=True)
  key = next((r for r in result["sharing"].get("tiny", [])
              if r["prefix"] == 4096 and r["branches"] == 16), None)
  util = result["utilization"]
  result["targets"] = {
      "tree_speedup_4k_16br_tiny": key and key["speedup_tree_vs_dup"],
      "kv_ratio_4k_16br_tiny": key and key["kv_ratio_dup_vs_tree"],
      "target_speedup": 3.0, "target_kv_ratio": 8.0,
      "task_affine_utilization": util["task_affine_w4"]["utilization"],
      "synchronous_utilization": util["synchronous"]["utilization"],
      "target_task_affine": 0.9, "target_synchronous_below": 0.6,
  }
  result["wall_s"] = time.perf_counter() - t_start
  with open(args.out + ".json", "w") as f:
    json.dump(result, f, indent=1)
  plot(result, series, args.out + ".png")
  print(f"wrote {args.out}.json and .png in {result['wall_s']:.0f}s")


if __name__ == "__main__":
  main()
