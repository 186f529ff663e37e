"""How large a comparison must be to tell a gain of the size measured from none.

  python projects/lessons/power.py [--summary projects/lessons/results/pilot/lessons/summary.json]
      [--arm trace_paper] [--reference grpo] [--out projects/lessons/results/power]

Reads the run rows of a `lessons_table.py` summary (each with `arm`, `world_seed`,
`warm_start_seed`, `seed`, `em_at_equal_tokens`, `wall_seconds`), keeps the two arms, and fits
the simplest model the pooled bootstrap assumes: in cell c (a world seed and a warm start) run i
of arm a scores

    y = mu_a + cell_c + (a == arm) * delta_c + e,   e ~ N(0, sigma^2),  delta_c ~ N(delta, tau^2)

so sigma is the spread between RL seeds of one arm in one cell, and tau the spread of the true
gain between cells (worlds and warm starts). Estimates: sigma^2 pooled within (cell, arm) over
every cell; tau^2 by moments from the spread of the cells' differences, less their sampling
variance (never below 0), with a one-sided 90% upper bound from the chi-square law of that
spread (cells of equal size). With only one world holding two warm starts, tau is not split into
a world part and a warm-start part: all of it is charged to the world (a design with two warm
starts per world is then priced at no benefit from its second; conservative).

A design of W worlds x C warm starts x n RL seeds per arm, its estimate the mean over worlds of
each world's difference (each world weighing the same, as `lessons_table.py`'s pooled figure),
has standard error sqrt((tau^2 + 2 sigma^2 / (C n)) / W). Written per design, for tau at 0, at
its estimate and at its upper bound: the standard error, the smallest gain detected 80% of the
time by a two-sided 5% test (2.80 standard errors), the chance of an interval above 0 if the
gain is the one measured, the runs it takes (both arms), and their single-core hours at the
median wall time of the runs read (their length: the length of the runs read; each shared the 2
cores with at least one other process), plus one warm start per world and warm start at the
median SFT time of those the archived runs built. Writes
`power.json` and `power.png` (the detectable gain against single-core hours).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
from collections import defaultdict
from statistics import NormalDist

import numpy as np
from scipy.stats import chi2

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")

from launch.campaign import archived_records, read_summary  # noqa: E402

Z_TEST, Z_POWER = NormalDist().inv_cdf(0.975), NormalDist().inv_cdf(0.8)  # two-sided 5%, 80%
DESIGNS = [(w, c, n) for w in (1, 2, 3, 4, 6, 8, 12, 16, 24) for c in (1, 2) for n in (1, 2, 3, 5)]


def cells_of(runs: list[dict], arm: str, reference: str, key: str = "em_at_equal_tokens"
             ) -> dict[tuple, dict[str, list[float]]]:
  """{(world, warm start): {arm: [scores], reference: [scores]}}, cells holding both arms."""
  cells: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
  for r in runs:
    if r.get("arm") in (arm, reference) and r.get(key) is not None:
      cells[(r.get("world_seed"), r.get("warm_start_seed"))][r["arm"]].append(float(r[key]))
  return {c: dict(v) for c, v in cells.items() if len(v.get(arm, ())) and len(v.get(reference, ()))}


def variance_components(cells: dict, arm: str, reference: str) -> dict:
  """sigma (between seeds), tau (between cells' gains) with its 90% upper bound, and the mean
  gain over cells with its standard error under the fitted model."""
  if len(cells) < 2:
    raise ValueError(f"need at least 2 cells holding both arms, got {len(cells)}")
  ss, df = 0.0, 0
  for v in cells.values():
    for a in (arm, reference):
      y = np.asarray(v[a])
      ss += float(((y - y.mean()) ** 2).sum())
      df += len(y) - 1
  if df < 1:
    raise ValueError("need at least one cell and arm with two or more seeds to estimate sigma")
  sigma2 = ss / df
  d = np.array([np.mean(v[arm]) - np.mean(v[reference]) for v in cells.values()])
  by_world = defaultdict(list)
  for c, x in zip(cells, d):
    by_world[c[0]].append(x)
  samp = np.array([sigma2 * (1 / len(v[arm]) + 1 / len(v[reference])) for v in cells.values()])
  k = len(d)
  s2 = float(np.var(d, ddof=1))
  tau2 = max(0.0, s2 - float(samp.mean()))
  tau2_hi = max(0.0, (k - 1) * s2 / float(chi2.ppf(0.10, k - 1)) - float(samp.mean()))
  return dict(cells=k, seed_df=df, sigma=math.sqrt(sigma2), tau=math.sqrt(tau2),
              tau_upper90=math.sqrt(tau2_hi), cell_diff_sd=math.sqrt(s2),
              mean_diff=float(np.mean([np.mean(x) for x in by_world.values()])),
              worlds=len(by_world), cell_mean_diff=float(d.mean()),
              cell_mean_diff_se=math.sqrt((tau2 + samp.mean()) / k),
              cell_diffs={f"w{c[0]}-ws{c[1]}": float(x) for c, x in zip(cells, d)})


def design_se(sigma: float, tau: float, worlds: int, warm_starts: int, seeds: int) -> float:
  if min(worlds, warm_starts, seeds) < 1:
    raise ValueError(f"a design needs >= 1 world, warm start and seed, got "
                     f"{(worlds, warm_starts, seeds)}")
  return math.sqrt((tau ** 2 + 2 * sigma ** 2 / (warm_starts * seeds)) / worlds)


def warm_start_seconds(arms_dir: str) -> list[float]:
  """The SFT seconds of every warm start built by a run archived under `arms_dir` (each
  `<cell>/<arm>/` output folder; the run that built one logs its SFT steps, the others read it
  from the cache)."""
  out = []
  for arm_dir in sorted(glob.glob(os.path.join(arms_dir, "*", "*", ""))):
    for row in (read_summary(arm_dir, missing_ok=True) or {}).get("runs", []):
      sft = [r["sft_seconds"] for r in archived_records(arm_dir, row["run"]) or []
             if "sft_seconds" in r]
      if sft:
        out.append(float(sft[-1]))
  return out


def design_table(sigma: float, taus: dict[str, float], gain: float, core_hours_per_run: float,
                 core_hours_per_warm_start: float = 0.0, designs=DESIGNS) -> list[dict]:
  rows = []
  for w, c, n in designs:
    row = dict(worlds=w, warm_starts=c, seeds=n, runs=2 * w * c * n,
               core_hours=round(2 * w * c * n * core_hours_per_run
                                + w * c * core_hours_per_warm_start, 1))
    for name, tau in taus.items():
      se = design_se(sigma, tau, w, c, n)
      row[f"se_{name}"] = se
      row[f"detectable_{name}"] = (Z_TEST + Z_POWER) * se
      row[f"power_at_measured_{name}"] = NormalDist().cdf(gain / se - Z_TEST)
    rows.append(row)
  return rows


def cheapest(rows: list[dict], target: float, tau_name: str) -> dict | None:
  """The design with the fewest runs whose detectable gain is at most `target`."""
  ok = [r for r in rows if r[f"detectable_{tau_name}"] <= target]
  return min(ok, key=lambda r: (r["runs"], r[f"detectable_{tau_name}"])) if ok else None


def plot(rows: list[dict], comps: dict, gain: float, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  names = [("0", "tau = 0"), ("est", f"tau = {comps['tau']:.3f} (estimate)"),
           ("hi", f"tau = {comps['tau_upper90']:.3f} (90% upper)")]
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.6), sharey=True)
  for ax, (key, title) in zip(axes, names):
    for n, marker in zip((1, 2, 3, 5), "osD^"):
      for c, ls in ((1, "-"), (2, "--")):
        rs = sorted((r for r in rows if r["seeds"] == n and r["warm_starts"] == c),
                    key=lambda r: r["core_hours"])
        ax.plot([r["core_hours"] for r in rs], [100 * r[f"detectable_{key}"] for r in rs], ls,
                marker=marker, ms=4, label=f"{n} seed{'s' * (n > 1)} x {c} warm start"
                f"{'s' * (c > 1)} per world")
    ax.axhline(100 * gain, color="k", lw=1, label=f"gain measured ({100 * gain:+.1f})")
    ax.axhline(3.0, color="tab:red", lw=1, ls=":", label="the issue's aim (+3)")
    ax.set_xscale("log")
    ax.set_xlabel("single-core hours, runs and warm starts\n(points: 1, 2, 3, 4, 6, 8, 12, 16, "
                  "24 worlds)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
  axes[0].set_ylabel("gain detected 80% of the time (EM points)")
  axes[0].set_ylim(0, 12)
  axes[-1].legend(fontsize=7, loc="upper right")
  fig.suptitle(f"sigma between seeds {comps['sigma']:.4f}, {comps['cells']} cells", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--summary", default=os.path.join(_ROOT, "projects", "lessons", "results",
                                                   "pilot", "lessons", "summary.json"))
  p.add_argument("--arms", default=None, help="the arms folder of the archived runs, for the "
                 "warm starts' cost (default: the summary's parent's parent)")
  p.add_argument("--arm", default="trace_paper")
  p.add_argument("--reference", default="grpo")
  p.add_argument("--out", default=os.path.join(_ROOT, "projects", "lessons", "results", "power"))
  a = p.parse_args(argv)
  with open(a.summary) as f:
    runs = json.load(f)["runs"]
  cells = cells_of(runs, a.arm, a.reference)
  comps = variance_components(cells, a.arm, a.reference)
  walls = [r["wall_seconds"] for r in runs if r.get("arm") in (a.arm, a.reference)
           and (r.get("world_seed"), r.get("warm_start_seed")) in cells and r.get("wall_seconds")]
  steps = sorted({r.get("steps") for r in runs if r.get("arm") in (a.arm, a.reference)} - {None})
  hours = float(np.median(walls)) / 3600 if walls else float("nan")
  sft = warm_start_seconds(a.arms or os.path.dirname(os.path.dirname(a.summary)))
  ws_hours = float(np.median(sft)) / 3600 if sft else 0.0
  taus = {"0": 0.0, "est": comps["tau"], "hi": comps["tau_upper90"]}
  rows = design_table(comps["sigma"], taus, comps["mean_diff"], hours, ws_hours)
  targets = {f"{t:+.3f}": {k: cheapest(rows, t, k) for k in taus}
             for t in (abs(comps["mean_diff"]), 0.02, 0.03)}
  preregistered = next(r for r in rows if (r["worlds"], r["warm_starts"], r["seeds"]) == (1, 2, 5))
  result = dict(command="python projects/lessons/power.py " + " ".join(
      argv if argv is not None else sys.argv[1:]), summary=os.path.relpath(a.summary, _ROOT),
      arm=a.arm, reference=a.reference, run_steps=steps, core_hours_per_run=hours,
      core_hours_per_warm_start=ws_hours, warm_starts_timed=len(sft),
      components=comps, cheapest_detecting=targets, preregistered_design=preregistered,
      designs=rows)
  os.makedirs(a.out, exist_ok=True)
  with open(os.path.join(a.out, "power.json"), "w") as f:
    json.dump(result, f, indent=1)
  plot(rows, comps, comps["mean_diff"], os.path.join(a.out, "power.png"))
  print(json.dumps({k: result[k] for k in ("components", "core_hours_per_run", "run_steps",
                                           "core_hours_per_warm_start")},
                   indent=1))
  for t, by in targets.items():
    for k, r in by.items():
      print(f"gain {t}, tau {k}: " + ("none in the grid" if r is None else
            f"{r['worlds']} worlds x {r['warm_starts']} x {r['seeds']} seeds, {r['runs']} runs, "
            f"{r['core_hours']} core-hours"))
  print("the pre-registered design (1 world x 2 warm starts x 5 seeds):",
        {k: round(v, 4) if isinstance(v, float) else v for k, v in preregistered.items()})


if __name__ == "__main__":
  main()
