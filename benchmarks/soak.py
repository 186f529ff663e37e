"""A soak of the tree sampler: does a long run of the training loop's sampling grow in memory?

  python benchmarks/soak.py --decode_steps=300000 --every=250 --out=results/soak

(`results/soak.json`: about 10 minutes on 2 CPU cores; the default, 10,000 decode steps, a minute.)

Drives one `SamplerEngine` (a tiny random Qwen3, as `tests/test_sampler.py` builds one) the way
the training loop does, round after round: score a pool of candidate prompts keeping their K/V
(`prompt_features(keep=True)`), sample the chosen prompts as multi-turn trees in a scripted
environment, fork new branches from anchors at several depths, new weights every few rounds
(`update_params`), and release the round's trees (every few rounds everything, as an evaluation
does). Until the engine's `ledger.decode_steps` passes `--decode_steps` it samples, at regular
intervals of decode steps and always between rounds (no tree alive), the process's resident host
memory (VmRSS of /proc/self/status), the bytes of every live JAX array and the pool's free pages.

After a warm-up (the first `--warmup` share of the decode steps: compilation, allocator pools) a
least-squares line through each series gives its slope in bytes per 1000 decode steps. Rule: a
series is flat within noise when the growth its line predicts over the measured span,
|slope| x span, is at most max(3 x the slope's standard error x span, 0.5% of the series' mean):
the trend cannot be told from the samples' noise, or it moves the series by a negligible share.
The free pages between rounds must not move at all. Writes `<out>.json` (samples, slopes, decode
steps, wall time, the verdict and its rule) and `<out>.png`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import time

import numpy as np

RULE = ("flat within noise: |slope| x span <= max(3 x the slope's standard error x span, "
        "0.5% of the series' mean), fitted after the warm-up; free pages between rounds constant")
REL_FLOOR = 0.005  # 0.5% of the series' mean
NOISE_SIGMAS = 3.0


def rss_bytes() -> int:
  """Resident host memory of this process now (VmRSS), in bytes; the peak (ru_maxrss) where
  /proc is not there."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmRSS:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def device_bytes() -> tuple[int, int]:
  """(bytes, count) of every live JAX array."""
  import jax
  arrays = jax.live_arrays()
  return sum(int(x.nbytes) for x in arrays), len(arrays)


def fit_slope(steps, values) -> dict:
  """Least-squares line through (steps, values): its slope per 1000 steps, the slope's standard
  error, the residuals' standard deviation, the span of steps and the values' mean."""
  x = np.asarray(steps, np.float64)
  y = np.asarray(values, np.float64)
  if len(x) < 3 or np.ptp(x) == 0:
    raise ValueError(f"a slope needs at least 3 samples over more than one step, got {len(x)}")
  xm, ym = x.mean(), y.mean()
  sxx = float(((x - xm) ** 2).sum())
  slope = float(((x - xm) * (y - ym)).sum() / sxx)
  intercept = float(ym - slope * xm)
  resid = y - (intercept + slope * x)
  dof = len(x) - 2
  resid_std = float(np.sqrt((resid ** 2).sum() / dof)) if dof > 0 else 0.0
  se = resid_std / np.sqrt(sxx)
  return dict(slope_per_1k=slope * 1000.0, slope_se_per_1k=float(se) * 1000.0,
              intercept=intercept, resid_std=resid_std, span_steps=float(np.ptp(x)),
              mean=float(ym), samples=int(len(x)))


def is_flat(fit: dict, rel_floor: float = REL_FLOOR, sigmas: float = NOISE_SIGMAS) -> dict:
  """The verdict of `RULE` on one `fit_slope` result: the growth the line predicts over the span,
  the bound it is held to, and whether it stays within it."""
  growth = abs(fit["slope_per_1k"]) * fit["span_steps"] / 1000.0
  noise = sigmas * fit["slope_se_per_1k"] * fit["span_steps"] / 1000.0
  bound = max(noise, rel_floor * abs(fit["mean"]))
  return dict(growth_over_span=growth, bound=bound, flat=bool(growth <= bound))


def analyse(samples: list[dict], warmup: float, keys=("rss_bytes", "device_bytes")) -> dict:
  """Slopes and verdicts of `keys` over the samples past the warm-up share of decode steps."""
  last = samples[-1]["decode_steps"]
  start = warmup * last
  kept = [s for s in samples if s["decode_steps"] >= start]
  out = {"warmup_decode_steps": int(start), "samples_fitted": len(kept)}
  for k in keys:
    fit = fit_slope([s["decode_steps"] for s in kept], [s[k] for s in kept])
    out[k] = dict(fit, **is_flat(fit))
  pages = {s["free_pages"] for s in samples if s.get("between_rounds")}
  out["free_pages_between_rounds"] = sorted(pages)
  out["flat"] = bool(all(out[k]["flat"] for k in keys) and len(pages) <= 1)
  return out


def build_engine(args):
  import jax
  from flax import nnx

  from trace_jax.models.qwen3 import Qwen3, get_preset
  from trace_jax.sampling.engine import SamplerConfig, SamplerEngine
  from trace_jax.sampling.testing import IdTokenizer, ScriptedEnv

  vocab, eos, search, answer = 64, 1, 5, 6
  tok = IdTokenizer({search: "</search>", answer: "</answer>"})
  gd, st = nnx.split(Qwen3(get_preset("tiny", vocab_size=vocab), rngs=nnx.Rngs(0)))
  # As the sampler tests do: larger weights than a random init's, so branches differ.
  st = jax.tree.map(lambda x: x * 6.0, st)
  cfg = SamplerConfig(num_slots=args.slots, page_size=4, num_pages=args.pages, max_seq_len=96,
                      max_turn_tokens=7, max_obs_tokens=12, max_turns=4, prefill_chunk=(16,),
                      page_buckets=(24,), greedy=False, max_group_size=4, max_groups=4,
                      seed=args.seed)
  engine = SamplerEngine(gd, st, cfg, tok.encode, tok.decode, ScriptedEnv(vocab), eos_id=eos)
  return engine, st, vocab


def soak(args, progress=True) -> dict:
  import jax
  from tqdm.auto import tqdm

  from trace_jax.sampling.engine import ForkRequest, PromptRequest

  engine, params, vocab = build_engine(args)
  rng = np.random.default_rng(args.seed)
  pool = [list(rng.integers(8, vocab, int(rng.integers(3, 20)))) for _ in range(args.pool)]
  free0 = engine.alloc.num_free
  samples: list[dict] = []
  t0 = time.time()
  next_sample = 0

  def sample(rnd: int, between_rounds: bool):
    dev, n = device_bytes()
    samples.append(dict(round=rnd, decode_steps=int(engine.ledger.decode_steps),
                        wall_s=round(time.time() - t0, 2), rss_bytes=rss_bytes(),
                        device_bytes=dev, live_arrays=n, py_objects=len(gc.get_objects()),
                        free_pages=int(engine.alloc.num_free), between_rounds=between_rounds))

  bar = tqdm(total=args.decode_steps, desc="soak (decode steps)", disable=not progress,
             mininterval=2.0, unit="step")
  sample(0, True)
  rnd = 0
  while engine.ledger.decode_steps < args.decode_steps:
    rnd += 1
    before = engine.ledger.decode_steps
    engine.set_uid_base(rnd * 1000)  # as the loop does per RL step
    engine.prompt_features(pool, keep=True)  # the candidate pool, its K/V kept for sampling
    if rnd % 5 == 0:  # new weights (the same values, new arrays): the kept pages go back
      engine.update_params(jax.tree.map(lambda x: x + 0.0, params))
    pick = [pool[j] for j in rng.choice(len(pool), size=args.prompts, replace=False)]
    trees = engine.run([PromptRequest(p, n=args.rollouts) for p in pick])
    engine.run([ForkRequest(t, a.id, 1) for t in trees for a in t.anchors()
                if a.depth in (0, 1, 2)])
    if rnd % 7 == 0:  # an evaluation's release of everything
      engine.prompt_features(pool, keep=True)
      engine.release()
    else:
      engine.release(trees)
    bar.update(engine.ledger.decode_steps - before)
    if engine.ledger.decode_steps >= next_sample:
      sample(rnd, True)
      next_sample = engine.ledger.decode_steps + args.every
  if samples[-1]["decode_steps"] != engine.ledger.decode_steps:
    sample(rnd, True)
  bar.close()
  wall = time.time() - t0
  verdict = analyse(samples, args.warmup)
  # Where host memory goes, for the reader (not in the verdict): the Python objects the
  # collector tracks, fitted the same way.
  objs = fit_slope(*zip(*[(x["decode_steps"], x["py_objects"]) for x in samples
                          if x["decode_steps"] >= verdict["warmup_decode_steps"]]))
  verdict["py_objects"] = dict(objs, **is_flat(objs))
  verdict["pages_returned"] = bool(engine.alloc.num_free == free0)
  verdict["flat"] = bool(verdict["flat"] and verdict["pages_returned"])
  return dict(command="python benchmarks/soak.py " + " ".join(args.argv),
              decode_steps=int(engine.ledger.decode_steps), rounds=rnd,
              generated_tokens=int(engine.ledger.generated_tokens),
              rollouts=int(engine.ledger.rollouts_started), wall_seconds=round(wall, 1),
              sample_every_decode_steps=args.every, warmup_share=args.warmup, rule=RULE,
              verdict=verdict, compile_counts=engine.compile_counts(),
              machine=dict(platform=platform.platform(), cpus=os.cpu_count(),
                           backend=jax.default_backend()),
              samples=samples)


def plot(result: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  s = result["samples"]
  x = np.array([r["decode_steps"] for r in s], np.float64)
  v = result["verdict"]
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for ax, key, title in ((axes[0], "rss_bytes", "host RSS"),
                         (axes[1], "device_bytes", "live JAX arrays")):
    y = np.array([r[key] for r in s], np.float64) / 2**20
    fit = v[key]
    ax.axvspan(0, v["warmup_decode_steps"], color="0.9", label="warm-up")
    ax.plot(x, y, ".", ms=3, label=title)
    xs = x[x >= v["warmup_decode_steps"]]
    ax.plot(xs, (fit["intercept"] + fit["slope_per_1k"] / 1000.0 * xs) / 2**20, "r-",
            label=f"fit {fit['slope_per_1k'] / 1024:+.2f} KiB / 1k steps "
                  f"({'flat' if fit['flat'] else 'GROWS'})")
    ax.set_xlabel("decode steps")
    ax.set_ylabel("MiB")
    ax.set_title(title)
    ax.legend(fontsize=8)
  fig.suptitle(f"sampler soak: {result['decode_steps']} decode steps, {result['rounds']} rounds, "
               f"{result['wall_seconds']:.0f} s")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main(argv=None):
  import sys
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--decode_steps", type=int, default=10000, help="decode steps to run at least")
  ap.add_argument("--every", type=int, default=100, help="decode steps between samples")
  ap.add_argument("--warmup", type=float, default=0.2,
                  help="share of the decode steps left out of the fit")
  ap.add_argument("--slots", type=int, default=8)
  ap.add_argument("--pages", type=int, default=512)
  ap.add_argument("--pool", type=int, default=8, help="candidate prompts scored per round")
  ap.add_argument("--prompts", type=int, default=3, help="prompts sampled per round")
  ap.add_argument("--rollouts", type=int, default=2, help="rollouts per prompt")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", default="results/soak", help="writes OUT.json and OUT.png")
  args = ap.parse_args(argv)
  args.argv = list(sys.argv[1:] if argv is None else argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  result = soak(args)
  out = args.out[:-5] if args.out.endswith(".json") else args.out
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out + ".json", "w") as f:
    json.dump(result, f, indent=1)
  plot(result, out + ".png")
  print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))


if __name__ == "__main__":
  main()
