"""The smoke run with an ample KV pool and with a pool at a fraction of what it needs: the records
must agree (the tight pool evicts cached K/V and preempts branches instead of cutting them,
`trace_jax.sampling.engine_preempt`).

  python benchmarks/pool_preemption.py --out=results/pool_preemption.json [--steps=6] [--share=0.25]

First the ample run (the smoke's 1024 pages) measures the peak of pages in use per step
(`sampler_peak_pages`); the tight run gets `--share` of that peak. Every record field is compared,
except the sampler's own counters (`sampler_*`), the decode-step and slot counts (a tight pool
runs more, shorter calls) and wall-clock fields. Fields are either equal, or differ by float
rounding only: a preempted branch's K/V is recomputed by a prefill, not the decode step that first
wrote it, so its later log-probs (and the losses read from them) may differ in the last bits.
Any other difference (a reward, a token count, a token sampled differently) fails the run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from trace_jax.record_compare import compare_records

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# Counts of the sampler's schedule, not of what it sampled.
SCHEDULE = ("ledger_decode_steps", "ledger_busy_slot_steps", "ledger_total_slot_steps",
            "ledger_empty_slot_steps", "slot_utilization")


def _ignored(key: str) -> bool:
  return (key.startswith("sampler_") or key in SCHEDULE or key.endswith(("seconds", "_s", "per_s"))
          or "wall" in key)


def compare(ample: list[dict], tight: list[dict]) -> dict:
  """`trace_jax.record_compare.compare_records` of the two runs, the schedule's fields aside."""
  return compare_records(ample, tight, ignored=_ignored)


def _train(workdir: str, cache: str, steps: int, extra: list[str]) -> tuple[list[dict], float]:
  cmd = [sys.executable, os.path.join(ROOT, "launch", "train.py"), "--config=configs/mhqa.py:smoke",
         f"--workdir={workdir}", f"--config.world.cache_dir={cache}", f"--config.rl.steps={steps}",
         *extra]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  res = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True)
  if res.returncode:
    raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stdout[-3000:]}")
  with open(os.path.join(workdir, "summary.json")) as f:
    wall = json.load(f)["wall_seconds"]
  with open(os.path.join(workdir, "metrics.jsonl")) as f:  # (the warm start: cached, shared)
    return [r for r in map(json.loads, f) if r.get("step", 0) >= 0], wall


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", default="results/pool_preemption.json")
  ap.add_argument("--steps", type=int, default=6)
  ap.add_argument("--share", type=float, default=0.25)
  args = ap.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    cache = os.path.join(tmp, "cache")
    print("ample pool ...", flush=True)
    ample, ample_s = _train(os.path.join(tmp, "ample"), cache, args.steps, [])
    peak = max(r.get("sampler_peak_pages", 0) for r in ample)
    pages = max(2, int(peak * args.share))
    print(f"peak {peak} pages; tight pool of {pages} ...", flush=True)
    tight, tight_s = _train(os.path.join(tmp, "tight"), cache, args.steps,
                            [f"--config.rollout.num_pages={pages}"])
  steps = [r for r in tight if "sampler_peak_pages" in r]
  result = dict(
      command=" ".join(sys.argv), steps=args.steps, ample_peak_pages=peak, tight_num_pages=pages,
      tight_peak_pages=max(r["sampler_peak_pages"] for r in steps),
      preemptions=sum(r["sampler_preemptions"] for r in steps),
      recomputed_tokens=sum(r["sampler_recomputed_tokens"] for r in steps),
      system_cut_leaves=sum(r.get("system_cut_leaves", 0) for r in steps),
      # One run each, on a shared machine: a rough price of the recompute, not a benchmark.
      wall_seconds={"ample": round(ample_s, 1), "tight": round(tight_s, 1)},
      per_step=[{k: r[k] for k in ("step", "sampler_preemptions", "sampler_recomputed_tokens",
                                   "sampler_peak_pages", "reward_mean", "loss", "grad_norm",
                                   "generated_tokens_total") if k in r} for r in steps],
      comparison=compare(ample, tight))
  result["verdict"] = ("same records up to float rounding" if not result["comparison"]["different"]
                       else "records differ")
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  c = result["comparison"]
  print(f"{result['verdict']}: {c['equal']} fields equal, {c['rounding']} by rounding (max "
        f"relative {c['max_relative']:.2e}), {len(c['different'])} different; "
        f"{result['preemptions']} preemptions, {result['recomputed_tokens']} tokens recomputed, "
        f"peak {result['tight_peak_pages']} of {pages} pages (ample: {peak})")
  if c["different"]:
    raise SystemExit(1)


if __name__ == "__main__":
  main()
