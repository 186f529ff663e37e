"""LoRA against full fine-tuning on one device: the sampler's decode with merged vs unmerged
adapters, and the update step's memory (`compiled.memory_analysis()`) and time.

1. Sampler: the same engine workload (prompts x rollouts, one turn each, stop tags on) run with
   merged weights (W + (alpha / r) A B formed once per step, `models.lora.merged_weights`; the
   engine on the plain graph) and unmerged ones (base and adapters, the low-rank product in every
   projection). Modes interleaved over reps after a warm-up run each; generated tokens/s, and the
   time of one merge (paid once per RL step).
2. Update: one jitted update at the same batch shape, full fine-tuning (f32 masters and Adam
   moments of every weight) vs LoRA (the frozen base as an argument, f32 adapters and moments):
   argument, output and temporary bytes of the compiled step, and the median step time.

Usage: python benchmarks/bench_lora.py [--model d512_l8] [--rank 8] [--reps 3]
       [--out results/lora_cpu.json]
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

from trace_jax.models import lora
from trace_jax.models.predictor import PredictorHead
from trace_jax.models.qwen3 import Qwen3, Qwen3Config, get_preset
from trace_jax.rl.update import UpdateConfig, init_train_state, jit_update_step
from trace_jax.sampling.engine import PromptRequest, SamplerConfig, SamplerEngine
from trace_jax.sampling.testing import IdTokenizer, ScriptedEnv

VOCAB = 2048
MODELS = {
    "tiny": get_preset("tiny", vocab_size=VOCAB, max_position_embeddings=4096),
    "d512_l8": Qwen3Config(vocab_size=VOCAB, hidden_size=512, intermediate_size=1536, num_layers=8,
                           num_heads=8, num_kv_heads=4, head_dim=64, tie_word_embeddings=True,
                           max_position_embeddings=4096, rope_theta=10_000.0),
}


def _adapted(cfg, rank, seed=0):
  g, p = nnx.split(Qwen3(cfg, rngs=nnx.Rngs(seed)))
  lg, base, adapters = lora.adapt(g, p, rank, 2.0 * rank, "all", seed + 1)
  leaves, tree = jax.tree.flatten(adapters)  # B off zero: the adapters act
  adapters = jax.tree.unflatten(tree, [x + 0.01 * jax.random.normal(jax.random.key(i), x.shape)
                                       for i, x in enumerate(leaves)])
  return g, p, lg, base, adapters


def sampler(cfg, rank: int, reps: int, prompts: int = 8, rollouts: int = 8):
  g, _, lg, base, adapters = _adapted(cfg, rank)
  scfg = SamplerConfig(num_slots=32, page_size=16, num_pages=2048, max_seq_len=256,
                       max_turn_tokens=48, max_obs_tokens=16, max_turns=2, page_buckets=(16,),
                       prefill_chunk=(64,), prefill_batch=8)
  tok = IdTokenizer({5: "</search>", 6: "</answer>"})
  engines = {
      "merged": SamplerEngine(g, lora.merged_weights(lg, base, adapters), scfg, tok.encode,
                              tok.decode, ScriptedEnv(VOCAB, max_depth=2, obs_growth=4), eos_id=1),
      "unmerged": SamplerEngine(lg, lora.combined(base, adapters), scfg, tok.encode, tok.decode,
                                ScriptedEnv(VOCAB, max_depth=2, obs_growth=4), eos_id=1)}
  rates = {k: [] for k in engines}
  for i in range(reps + 1):
    for name, engine in engines.items():
      rng = np.random.default_rng(i)  # the same prompts for both modes
      reqs = [PromptRequest(list(rng.integers(8, VOCAB, 40)), n=rollouts) for _ in range(prompts)]
      g0, t0 = engine.ledger.generated_tokens, time.perf_counter()
      engine.run(reqs)
      if i:  # the first run compiles
        rates[name].append((engine.ledger.generated_tokens - g0) / (time.perf_counter() - t0))
      engine.release()
  merge_s = []
  for _ in range(reps + 1):
    t0 = time.perf_counter()
    jax.block_until_ready(lora.merged_weights(lg, base, adapters))
    merge_s.append(time.perf_counter() - t0)
  return {"generated_tok_s": rates,
          "median_tok_s": {k: float(np.median(v)) for k, v in rates.items()},
          "merge_seconds": float(np.median(merge_s[1:]))}


def _batch(rows, seq, k=4, seed=0):
  rs = np.random.RandomState(seed)
  mask = (rs.rand(rows, seq) < 0.5).astype(np.float32)
  mask[:, 0] = 0
  return {"tokens": rs.randint(0, VOCAB, (rows, seq)).astype(np.int32),
          "segment_ids": np.ones((rows, seq), np.int32),
          "positions": np.tile(np.arange(seq, dtype=np.int32), (rows, 1)), "mask": mask,
          "adv": rs.randn(rows, seq).astype(np.float32),
          "old_logp": np.full((rows, seq), -7.0, np.float32),
          "ref_logp": np.zeros((rows, seq), np.float32),
          "pred_pos": rs.randint(0, seq, (rows, k)).astype(np.int32),
          "pred_target": rs.rand(rows, k).astype(np.float32),
          "pred_weight": np.ones((rows, k), np.float32)}


def update(cfg, rank: int, reps: int, rows: int = 8, seq: int = 256):
  g, p, lg, base, adapters = _adapted(cfg, rank)
  hg, hp = nnx.split(PredictorHead(cfg.hidden_size, 128, rngs=nnx.Rngs(1)))
  ucfg = UpdateConfig(lr=1e-5, micro_batches=2)
  batch = _batch(rows, seq)
  out = {}
  for name in ("full", "lora"):
    if name == "full":
      state = init_train_state(jax.tree.map(jnp.copy, p), jax.tree.map(jnp.copy, hp), ucfg)
      step, extra = jit_update_step(g, hg, ucfg), ()
    else:
      state = init_train_state(jax.tree.map(jnp.copy, adapters), jax.tree.map(jnp.copy, hp),
                               ucfg)
      step, extra = jit_update_step(lg, hg, ucfg, lora=True), (base,)
    m = step.lower(state, batch, *extra).compile().memory_analysis()
    times = []
    for _ in range(reps + 1):
      t0 = time.perf_counter()
      state, _ = jax.block_until_ready(step(state, batch, *extra))
      times.append(time.perf_counter() - t0)
    trained = sum(x.size for x in jax.tree.leaves(state["params"]))
    out[name] = {"argument_mb": m.argument_size_in_bytes / 2**20,
                 "output_mb": m.output_size_in_bytes / 2**20,
                 "temp_mb": m.temp_size_in_bytes / 2**20,
                 "alias_mb": m.alias_size_in_bytes / 2**20,
                 "trained_params": int(trained), "step_seconds": float(np.median(times[1:]))}
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--model", default="d512_l8", choices=sorted(MODELS))
  ap.add_argument("--rank", type=int, default=8)
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--out", default="results/lora_cpu.json")
  a = ap.parse_args()
  cfg = MODELS[a.model]
  res = {"model": a.model, "rank": a.rank, "device": jax.devices()[0].device_kind,
         "platform": platform.platform(), "cpus": os.cpu_count(),
         "sampler": sampler(cfg, a.rank, a.reps), "update": update(cfg, a.rank, a.reps)}
  os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
  with open(a.out, "w") as f:
    json.dump(res, f, indent=1)
  print(json.dumps(res, indent=1))


if __name__ == "__main__":
  main()
