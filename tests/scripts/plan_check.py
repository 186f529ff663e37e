"""The memory plan against XLA's own figures; prints a JSON summary (and writes it with --out).

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/scripts/plan_check.py \
      --mode both --out results/plan_check.json

Run by tests/test_plan.py in a fresh process with 8 fake CPU devices, mesh data:2,fsdp:2,tensor:2:
compiles (never runs) the update step as `train.build` jits it and the sampler's decode step, and
reads `compiled.memory_analysis()` next to `trace_jax.plan`'s figures for the same shapes.
"""

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax import plan
from trace_jax.models.predictor import PredictorHead
from trace_jax.models.qwen3 import Qwen3, Qwen3Config
from trace_jax.parallel import make_mesh, shard_state
from trace_jax.parallel.sharding import batch_sharding
from trace_jax.rl import update as U

MESH = "data:2,fsdp:2,tensor:2"


def model_config(**kw):
  # Qwen3's layout at small width: GQA (8 query heads over 4 KV heads), q/k norms, untied lm_head
  # (as Qwen3-8B and 14B), bf16 parameters.
  base = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=2, num_heads=8,
              num_kv_heads=4, head_dim=64, dtype="float32", param_dtype="bfloat16")
  base.update(kw)
  return Qwen3Config(**base)


def measured(compiled) -> dict:
  m = compiled.memory_analysis()
  out = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp")}
  out["total"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
  return out


def planned(p: plan.StepPlan) -> dict:
  return {"argument": p.argument, "output": p.output, "alias": p.alias, "temp": p.temp,
          "total": p.total, "terms": p.terms}


def update_check(rows, seq_len, micro, remat, vocab, packing="none", lora_rank=0):
  cfg = model_config(vocab_size=vocab)
  mesh = make_mesh(MESH)
  graphdef, params = nnx.split(nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0))))
  pred_graphdef, pred = nnx.split(nnx.eval_shape(lambda: PredictorHead(cfg.hidden_size, 256,
                                                                       rngs=nnx.Rngs(1))))
  ucfg = U.UpdateConfig(micro_batches=micro, remat=remat, param_dtype=cfg.param_dtype,
                        kl_coef=0.001)
  extra, kw = (), {}
  if lora_rank:  # as train.build: the adapters are the state, the frozen base an argument
    from trace_jax.models import lora

    def adapted():
      m = Qwen3(cfg, rngs=nnx.Rngs(0))
      return lora.attach(m, lora_rank, 2.0 * lora_rank, "all", nnx.Rngs(1))
    graphdef, params, base = nnx.split(nnx.eval_shape(adapted), nnx.LoRAParam, ...)
    extra, kw = (base,), dict(lora=True, base_shardings=U.state_shardings(base, mesh))
  state = jax.eval_shape(lambda p, q: U.init_train_state(p, q, ucfg), params, pred)
  sh = U.state_shardings(state, mesh)
  k = 18

  def arr(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding(mesh, len(shape)))
  batch = {n: arr((rows, seq_len), jnp.int32) for n in ("tokens", "segment_ids", "positions")}
  batch.update({n: arr((rows, seq_len), jnp.float32)
                for n in ("mask", "adv", "old_logp", "ref_logp")})
  batch.update(pred_pos=arr((rows, k), jnp.int32), pred_target=arr((rows, k), jnp.float32),
               pred_weight=arr((rows, k), jnp.float32))
  if packing == "tree":
    batch.update(prev=arr((rows, seq_len), jnp.int32), kv_end=arr((rows, seq_len), jnp.int32))
  # As train.build: explicit state shardings, the batch's own (shard_batch) sharding, donation.
  step = U.jit_update_step(graphdef, pred_graphdef, ucfg, sh, None, mesh=mesh, **kw)
  got = measured(step.lower(state, batch, *extra).compile())
  want = planned(plan.plan_update_step(cfg, MESH, rows=rows, seq_len=seq_len,
                                       micro_batches=micro, remat=remat, preds_per_row=k,
                                       predictor_hidden=256, packing=packing,
                                       lora_rank=lora_rank))
  return {"measured": got, "plan": want}


def decode_check(num_slots, num_pages, page_size, max_seq_len, vocab):
  from trace_jax.sampling.engine_ops import make_decode_step
  from trace_jax.sampling.paged_kv import init_pool
  from trace_jax.sampling.config import SamplerConfig
  cfg = model_config(vocab_size=vocab)
  mesh = make_mesh(MESH)
  graphdef, params = nnx.split(Qwen3(cfg, rngs=nnx.Rngs(0)))
  params = shard_state(params, mesh)  # the policy weights as the update hands them over
  scfg = SamplerConfig(num_slots=num_slots, page_size=page_size, num_pages=num_pages,
                       max_seq_len=max_seq_len)
  # As SamplerEngine.__init__ builds it (outside any mesh).
  pool = init_pool(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim,
                   cfg.dtype)
  s, ng, gs, w = num_slots, scfg.num_groups, scfg.group_size, scfg.max_pages_per_seq
  z = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
  # One decode step per call (the engine's default is several; the step's temporaries are per
  # step), the batch as `make_decode_step` documents it, no stop sequences (a window of width 1).
  batch = dict(tokens=z(s), positions=z(s), write_pages=z(s, 1), budget=np.ones(s, np.int32),
               null=z(s), window=np.full((s, 1), -2, np.int32), counters=z(s),
               top_k=z(s), keys=np.zeros((s, 2), np.uint32),
               temperature=np.ones(s, np.float32), top_p=np.ones(s, np.float32),
               greedy=np.zeros(s, bool), group_pages=z(ng, w), group_lens=z(ng),
               group_slots=z(ng, gs), suffix_pages=z(s, w), suffix_lens=z(s))
  step = make_decode_step(graphdef, scfg.attention_impl, 0, False)
  got = measured(step.lower(params, pool, batch).compile())
  want = planned(plan.plan_decode_step(cfg, MESH, num_slots=num_slots, num_pages=num_pages,
                                       page_size=page_size, max_seq_len=max_seq_len))
  return {"measured": got, "plan": want}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--mode", choices=("update", "decode", "both", "all", "lora"), required=True)
  ap.add_argument("--lora_rank", type=int, default=16, help="--mode lora: the LoRA update")
  ap.add_argument("--rows", type=int, default=16)
  ap.add_argument("--seq_len", type=int, default=256)
  ap.add_argument("--micro", type=int, default=2)
  ap.add_argument("--remat", default="none")
  ap.add_argument("--vocab", type=int, default=4096)
  ap.add_argument("--slots", type=int, default=16)
  ap.add_argument("--pages", type=int, default=1024)
  ap.add_argument("--page_size", type=int, default=16)
  ap.add_argument("--out", default=None, help="also write the JSON (with each step's plan/measured "
                  "ratio) to this file")
  a = ap.parse_args()
  assert len(jax.devices()) == 8, jax.devices()
  res = {}
  if a.mode in ("update", "both", "all"):
    res["update"] = update_check(a.rows, a.seq_len, a.micro, a.remat, a.vocab)
  if a.mode == "all":  # the tree-packed update (rl.packing=tree) too
    res["update_tree"] = update_check(a.rows, a.seq_len, a.micro, a.remat, a.vocab, "tree")
  if a.mode == "lora":  # the LoRA update (model.lora.rank > 0) beside full fine-tuning's
    res["update"] = update_check(a.rows, a.seq_len, a.micro, a.remat, a.vocab)
    res["update_lora"] = update_check(a.rows, a.seq_len, a.micro, a.remat, a.vocab,
                                      lora_rank=a.lora_rank)
  if a.mode in ("decode", "both", "all"):
    res["decode"] = decode_check(a.slots, a.pages, a.page_size, a.seq_len, a.vocab)
  for step in res.values():
    step["plan_over_measured"] = {k: step["plan"][k] / step["measured"][k]
                                  for k in ("argument", "total") if step["measured"].get(k)}
  print(json.dumps(res))
  if a.out:
    res["command"] = ("XLA_FLAGS=--xla_force_host_platform_device_count=8 python "
                      "tests/scripts/plan_check.py " + " ".join(
                          f"--{k}={v}" for k, v in vars(a).items() if k != "out"))
    res["mesh"], res["jax"] = MESH, jax.__version__
    with open(a.out, "w") as f:
      json.dump(res, f, indent=1)


if __name__ == "__main__":
  main()
