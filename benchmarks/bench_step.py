"""Full RL steps per method and stage-2 mode: how busy the sampler's slots are (issue 29).

  python benchmarks/bench_step.py --steps=6 --warmup=2
  python benchmarks/bench_step.py --settings=trace_tree:stream --no_timing   # counts only
  python benchmarks/bench_step.py --settings=trace_tree:stream:nokeep       # pool prefilled twice

For each setting `method:stage2` (one process builds every run of the default config's warm
start in turn, after the warm-start probe fit of the head) it runs `--warmup` RL steps, then
`--steps` measured ones, and reports medians over the measured steps of: slot utilization (busy
slot steps / slot steps, from the engine's ledger), decode steps per RL step, prefill and
generated tokens per step, rollouts started (the budget, which the ledger proves), and, unless
`--no_timing`, the seconds of sampling and of the update; and per step from the first, the XLA
compilations and their seconds (`compiles_by_step`: the first steps' extra cost, issue 29 item
4; compiled functions are shared within a process, so compare settings run in processes of
their own, `--out` per setting). The counts do not depend on the machine's load; the seconds
do, so time only on an otherwise idle machine. `nokeep` in a setting turns the pool's kept K/V
off (`rollout.keep_pool_kv`): the pool prefilled to score, the sampled prompts again; `op`
turns rollouts one step ahead on (`rollout.off_policy_steps=1`; no evaluation or checkpoint
interrupts the measured steps, so every step starts the next one's rollouts) and adds the
median `staleness` (share of a step's tokens the previous weights generated); `dsN` sets
`rollout.decode_steps=N` (decode steps per device call). Idle slot steps are split into slots
with no branch (`empty_slot_share`) and slots whose turn ended inside a call
(`stopped_in_call_share`).
Writes results/step_bench.json ({"runs": [{"method", "stage2", "off_policy_steps",
"slot_utilization", "decode_steps_per_step", "prefill_tokens_per_step", "sample_s", "update_s",
...}]}) and results/step_bench.png.
"""

from __future__ import annotations

import json
import os
import platform
import sys

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

_CONFIG = flags.DEFINE_string("config", "tiny", "variant of configs/mhqa.py")
_SETTINGS = flags.DEFINE_string(
    "settings", "grpo:batch,trace_tree:batch,trace_tree:stream,trace_tree:stream:nokeep,"
    "tree_grpo:batch,tree_grpo:stream",
    "comma-separated method:stage2[:deadline][:nokeep][:op][:dsN] (deadline: "
    "rollout.stage2_deadline, stream only; nokeep: rollout.keep_pool_kv=False, the pool "
    "prefilled to score and the sampled prompts again; op: rollout.off_policy_steps=1; dsN: "
    "rollout.decode_steps=N)")
_STEPS = flags.DEFINE_integer("steps", 6, "measured RL steps per setting")
_WARMUP = flags.DEFINE_integer("warmup", 2, "RL steps before measuring (compilation)")
_NO_TIMING = flags.DEFINE_bool("no_timing", False, "leave the seconds out (a busy machine)")
_OUT = flags.DEFINE_string("out", "results/step_bench", "output stem")
_COMPILE_CACHE = flags.DEFINE_string(
    "compile_cache", "", "XLA's persistent compilation cache directory (train.use_compile_cache); "
    "empty: off. Run a setting twice on one directory to see what a machine's second run compiles")

_COMPILES = None  # trace_jax.diagnostics.CompileCounter, started in main


def measure(method: str, stage2: str, variant: str, steps: int, warmup: int,
            deadline: float = 0.0, keep: bool = True, off_policy: int = 0,
            decode_steps: int = 0) -> dict:
  from configs import mhqa
  from trace_jax import train

  c = mhqa.get_config(variant)
  c.method, c.rollout.stage2, c.rollout.stage2_deadline = method, stage2, deadline
  c.rollout.keep_pool_kv = keep
  c.rollout.off_policy_steps = off_policy
  if decode_steps:
    c.rollout.decode_steps = decode_steps
  # Steady state: no step is followed by an evaluation or a checkpoint (train.drains).
  c.eval.every = c.ckpt.every = 10**6
  if warmup + steps >= c.rl.steps:
    raise ValueError(f"warmup + steps must stay below rl.steps={c.rl.steps} (its last step "
                     "starts nothing ahead)")
  c.workdir = (f"/tmp/bench_step/{method}-{stage2}-{deadline}-{keep}-{off_policy}-"
               f"{c.rollout.decode_steps}")
  c = mhqa.validate(c)
  n0, s0 = _COMPILES.n, _COMPILES.s
  run = train.build(c)
  state = train.probe_warm_start(run, train.init_state(run))
  setup = dict(setup_compiles=_COMPILES.n - n0, setup_compile_s=round(_COMPILES.s - s0, 2))
  recs, compiles, compile_s = [], [], []
  for _ in range(warmup + steps):
    n0, s0 = _COMPILES.n, _COMPILES.s
    sample, rec = train.sample_step(run, state)
    state, rec = train.update_step(run, state, sample, rec)
    recs.append(rec)
    compiles.append(_COMPILES.n - n0)
    compile_s.append(round(_COMPILES.s - s0, 2))
  recs = recs[warmup:]

  def med(key):
    vals = [float(r[key]) for r in recs if key in r]
    return float(np.median(vals)) if vals else None

  util = [r["ledger_busy_slot_steps"] / max(r["ledger_total_slot_steps"], 1) for r in recs]
  # Idle slot steps split: no branch in the slot, or its turn ended inside a multi-step call.
  empty = [r.get("ledger_empty_slot_steps", 0) / max(r["ledger_total_slot_steps"], 1)
           for r in recs]
  return dict(method=method, stage2=stage2, stage2_deadline=deadline, off_policy_steps=off_policy,
              decode_steps=c.rollout.decode_steps,
              staleness=med("staleness"),
              keep_pool_kv=keep,
              steps=len(recs),
              slot_utilization=float(np.median(util)),
              empty_slot_share=float(np.median(empty)),
              stopped_in_call_share=float(np.median(1 - np.asarray(util) - np.asarray(empty))),
              decode_steps_per_step=med("ledger_decode_steps"),
              prefill_tokens_per_step=med("ledger_prefill_tokens"),
              generated_tokens_per_step=med("ledger_generated_tokens"),
              rollouts_per_step=med("ledger_rollouts_started"),
              effective_ratio=med("effective_ratio"),
              stage2_decisions=med("stage2_decisions"), stage2_unspent=med("stage2_unspent"),
              stage2_last_share=med("stage2_last_share"),
              sample_s=med("sample_seconds"), update_s=med("update_seconds"),
              # Per step from the first (warm-up included): XLA compilations and their seconds.
              compiles_by_step=compiles, compile_s_by_step=compile_s,
              # Build and warm-start probe (every method compiles its sampler and head there).
              **setup)


def main(argv):
  del argv
  global _COMPILES
  from trace_jax.diagnostics import CompileCounter
  _COMPILES = CompileCounter().start()
  from trace_jax.train import use_compile_cache
  cache = use_compile_cache(_COMPILE_CACHE.value)
  rows = []
  for setting in _SETTINGS.value.split(","):
    method, stage2, *rest = setting.split(":")
    keep = "nokeep" not in rest
    ds = [int(x[2:]) for x in rest if x.startswith("ds")]
    deadline = [float(x) for x in rest if x not in ("nokeep", "op") and not x.startswith("ds")]
    row = measure(method, stage2, _CONFIG.value, _STEPS.value, _WARMUP.value,
                  deadline[0] if deadline else 0.0, keep, int("op" in rest),
                  ds[0] if ds else 0)
    if _NO_TIMING.value:
      row.update(sample_s=None, update_s=None)
    rows.append(row)
    print(json.dumps(row), flush=True)
  out = dict(command="python benchmarks/bench_step.py " + " ".join(sys.argv[1:]),
             machine=platform.processor() or platform.machine(), cpus=os.cpu_count(),
             config=_CONFIG.value, timing=not _NO_TIMING.value, compile_cache=cache, runs=rows)
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  with open(_OUT.value + ".json", "w") as f:
    json.dump(out, f, indent=1)

  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  labels = [f"{r['method']}\n{r['stage2']}"
            + (f" dl {r['stage2_deadline']:g}" if r.get("stage2_deadline") else "")
            + ("" if r.get("keep_pool_kv", True) else " nokeep")
            + (" op" if r.get("off_policy_steps") else "")
            + (f" ds{r['decode_steps']}" if r.get("decode_steps", 8) != 8 else "") for r in rows]
  fig, axes = plt.subplots(1, 3, figsize=(14, 3.5))
  axes[0].bar(labels, [r["slot_utilization"] for r in rows], color="tab:blue")
  axes[0].axhline(0.85, color="grey", ls="--", lw=0.8)
  axes[0].set(title="slot utilization (median step)", ylim=(0, 1))
  axes[1].bar(labels, [r["decode_steps_per_step"] for r in rows], color="tab:orange")
  axes[1].set(title="decode steps per RL step")
  axes[2].bar(labels, [r["prefill_tokens_per_step"] for r in rows], color="tab:green")
  axes[2].set(title="prefill tokens per RL step")
  for ax in axes:
    ax.tick_params(axis="x", labelsize=8)
  fig.tight_layout()
  fig.savefig(_OUT.value + ".png", dpi=110)


if __name__ == "__main__":
  app.run(main)
