"""What decides when a run finds the trap-hop wording: its successful trap-hop rollouts per step.

  python projects/mhqa/trap_discovery.py --summaries=projects/mhqa/results/compare_trap09,\
projects/mhqa/results/compare_trap09_explore,projects/mhqa/results/compare_trap09_explore8,projects/mhqa/results/compare_trap09_platt,\
projects/mhqa/results/compare_trap09_hard,projects/mhqa/results/compare_trap09_hard4,projects/mhqa/results/compare_trap09_hardplatt

Reads the archived runs of `launch/compare.py` summaries (`<summary>/runs/<run>/metrics.jsonl.gz`)
whose steps log the trap-hop allocation (`diagnostics.trap_allocation`: synthetic-world runs from
the version that added it), and for each run sets its learning speed (the first evaluated step
with half its EM gain, `em_half_gain_step`) against the rollouts it spent on trap-hop questions
and the successes among them, averaged over the first `--first_steps` RL steps (before any run
has found the wording). Writes `<out>.json` (one row per run, and the rank correlation of each
quantity with the step of half the gain) and `<out>.png` (the scatter, one colour per summary and
method).
"""

from __future__ import annotations

import json
import os
import shlex
import sys

import numpy as np
from absl import app, flags

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")

from launch.campaign import archived_records, unique_runs  # noqa: E402
from launch.seed_stats import mean_of, spearman  # noqa: E402


def early_trap_stats(recs: list[dict], first_steps: int) -> dict | None:
  """Means over RL steps 1..first_steps of the rollouts on trap-hop questions, of the successful
  ones among them and of the success rates of trap-hop and other questions, with the run's mean
  predicted and realized stage-1 mixed share and pool trap share (its sampled trap share is
  `compare.py`'s `sampled_trap_share`, read from the summary by `collect`); None when the run did
  not log the trap split."""
  steps = [r for r in recs if "rollouts_trap_share" in r and 1 <= r.get("step", 0) <= first_steps]
  if not steps:
    return None
  trap = [r["rollouts_trap_share"] * r["leaves"] for r in steps]
  wins = [r.get("reward_trap", 0.0) * t for r, t in zip(steps, trap)]
  return dict(trap_rollouts_per_step=float(np.mean(trap)),
              trap_successes_per_step=float(np.mean(wins)),
              sampled_trap_share=float(np.mean([r["sampled_trap_share"] for r in steps])),
              pool_trap_share=float(np.mean([r["pool_trap_share"] for r in steps])),
              reward_trap=mean_of(steps, "reward_trap"),
              reward_other=mean_of(steps, "reward_other"),
              # over the whole run: what stage 1 expected of its groups, and what it got
              stage1_predicted_mixed=mean_of(recs, "stage1_predicted_mixed"),
              stage1_mixed=mean_of(recs, "stage1_mixed"),
              run_pool_trap_share=mean_of(recs, "pool_trap_share"),
              final_slice_calib=final_slice_calib(recs),
              steps=len(steps))


def final_slice_calib(recs: list[dict]) -> list[dict]:
  """The reliability bins of the run's last step that logs them (`slice_calib<i>_n`, `_pred`,
  `_outcome`: the random slice's rollouts by p̂ bin), non-empty bins only."""
  for r in reversed(recs):
    bins = sorted({int(k[len("slice_calib"):].split("_")[0]) for k in r
                   if k.startswith("slice_calib") and k.endswith("_n")})
    if bins:
      return [dict(n=r[f"slice_calib{i}_n"], pred=r[f"slice_calib{i}_pred"],
                   outcome=r[f"slice_calib{i}_outcome"]) for i in bins
              if r[f"slice_calib{i}_n"]]
  return []


def collect(summaries: list[str], first_steps: int) -> list[dict]:
  """One row per archived run (a run listed under both budget modes, as a method without a stage
  2 is, counted once), named by its summary directory and run path."""
  rows = []
  for d in summaries:
    for run in unique_runs(d):
      recs = archived_records(d, run["run"])
      if recs is None:
        continue
      stats = early_trap_stats(recs, first_steps)
      if stats is None:
        continue
      rows.append(dict(summary=os.path.basename(os.path.normpath(d)), run=run["run"],
                       method=run["method"], seed=run["seed"],
                       em_half_gain_step=run.get("em_half_gain_step"),
                       accuracy_final=run.get("accuracy_final"),
                       effective_ratio=run.get("effective_ratio"),
                       run_sampled_trap_share=run.get("sampled_trap_share"), **stats))
  return rows


def correlations(rows: list[dict]) -> dict:
  ok = [r for r in rows if r["em_half_gain_step"] is not None]
  steps = [r["em_half_gain_step"] for r in ok]
  return {k: spearman([r[k] for r in ok], steps)
          for k in ("trap_successes_per_step", "trap_rollouts_per_step", "sampled_trap_share")}


def plot(rows: list[dict], path: str, first_steps: int) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
  for ax, key, what in ((axes[0], "trap_rollouts_per_step", "trap-hop rollouts"),
                        (axes[1], "trap_successes_per_step", "successful trap-hop rollouts")):
    for label in sorted({(r["summary"], r["method"]) for r in rows}):
      pts = [r for r in rows if (r["summary"], r["method"]) == label and
             r["em_half_gain_step"] is not None]
      ax.scatter([r[key] for r in pts], [r["em_half_gain_step"] for r in pts],
                 label=f"{label[1]} ({label[0]})", s=30)
    rho = spearman([r[key] for r in rows if r["em_half_gain_step"] is not None],
                   [r["em_half_gain_step"] for r in rows if r["em_half_gain_step"] is not None])
    ax.set(xlabel=f"{what} per step (steps 1-{first_steps})",
           title="rank correlation " + ("-" if rho is None else f"{rho:.2f}"))
    ax.grid(alpha=0.3)
  axes[0].set_ylabel("first step with half the EM gain")
  axes[1].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)


def main(argv):
  del argv
  summaries = [s for s in _SUMMARIES.value.split(",") if s]
  rows = collect(summaries, _FIRST.value)
  if not rows:
    raise SystemExit(f"no archived run under {summaries} logs the trap-hop allocation "
                     f"(rollouts_trap_share): they predate it")
  out = dict(command="python projects/mhqa/trap_discovery.py " + shlex.join(sys.argv[1:]),
             first_steps=_FIRST.value, runs=rows, spearman_with_half_gain_step=correlations(rows))
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  with open(_OUT.value + ".json", "w") as f:
    json.dump(out, f, indent=1)
  plot(rows, _OUT.value + ".png", _FIRST.value)
  for r in rows:
    print(f"{r['summary']:24s} {r['method']:10s} seed {r['seed']}: half gain at step "
          f"{r['em_half_gain_step']}, {r['trap_successes_per_step']:.1f} trap successes / "
          f"{r['trap_rollouts_per_step']:.0f} trap rollouts per step")
  print("rank correlation with the step of half the gain:",
        json.dumps(out["spearman_with_half_gain_step"]))


if __name__ == "__main__":
  # Defined only when run as a script: the tests import this module next to compare.py, whose
  # flags share names with these in absl's global registry.
  _SUMMARIES = flags.DEFINE_string("summaries", "projects/mhqa/results/compare_trap09",
                                   "comma-separated compare.py output directories")
  _FIRST = flags.DEFINE_integer("first_steps", 4,
                                "RL steps averaged (1..first_steps); 4 is before any run of the "
                                "trap world has found the wording (the earliest at 6)")
  _OUT = flags.DEFINE_string("out", "projects/mhqa/results/trap_discovery",
                             "output path without extension")
  app.run(main)
