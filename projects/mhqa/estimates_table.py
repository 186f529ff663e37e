"""Issue 30's table: each estimate fix alone and together against the archived baseline, per
regime, with the predictor's calibration on the random slice.

  python projects/mhqa/estimates_table.py            # after projects/mhqa/estimates_campaign.sh

For every arm (a directory of `launch/compare.py` output, a method, a regime and a budget mode) it
reads each run's archived per-step records and reports, as mean ± std over seeds 0..seeds-1:
the mean held-out EM over the run (evaluations after step 0), the final EM, the effective ratio,
the slice AUC and expected calibration error (the run's last slice record: all slice rollouts of
the run), stage 1's expected mixed share (V_root of the p̂ it allocated by) next to the realized
one, the last update's clip fraction and approximate KL, and generated and prefill tokens per run.
Each arm is compared with the baseline of its regime and budget mode by Welch's t over seeds.
Writes `<out>.md`, `<out>.json` and `<out>.png` (the slice reliability diagram per regime: mean
outcome against mean p̂ in the five p̂ bins, pooled over the arm's seeds; and the mean EM over the
run per arm).
"""

from __future__ import annotations

import json
import os

import numpy as np
from absl import app, flags

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")

from launch.campaign import archived_records  # noqa: E402
from launch.seed_stats import fmt, fmt_welch, stats, welch  # noqa: E402

_RES = "projects/mhqa/results"
# (label, directory, method, regime, budget); the first arm of a (regime, budget) is its baseline.
_EST = f"{_RES}/estimates"
ARMS = (
    ("baseline (leaf means)", f"{_EST}/baseline", "trace_tree", "default", "rollouts"),
    ("children", f"{_EST}/children", "trace_tree", "default", "rollouts"),
    ("predictor", f"{_EST}/predictor", "trace_tree", "default", "rollouts"),
    ("discovery", f"{_EST}/discovery", "trace_tree", "default", "rollouts"),
    ("together", f"{_EST}/together", "trace_tree", "default", "rollouts"),
    ("grpo", f"{_EST}/grpo", "grpo", "default", "rollouts"),
    # The same settings as the next row, run again as its own arm: identical to the last digit.
    ("grpo, 2 epochs x 2 minibatches (rerun)", f"{_EST}/ppo_sweep_e2m2", "grpo", "default",
     "rollouts"),
    ("grpo, together's update", f"{_EST}/together_grpo", "grpo", "default", "rollouts"),
    ("baseline (leaf means)", f"{_EST}/baseline", "trace_tree", "low_contrast", "rollouts"),
    ("children", f"{_EST}/children", "trace_tree", "low_contrast", "rollouts"),
    ("predictor", f"{_EST}/predictor", "trace_tree", "low_contrast", "rollouts"),
    ("discovery", f"{_EST}/discovery", "trace_tree", "low_contrast", "rollouts"),
    ("together", f"{_EST}/together", "trace_tree", "low_contrast", "rollouts"),
    ("grpo", f"{_EST}/grpo", "grpo", "low_contrast", "rollouts"),
    ("grpo, together's update", f"{_EST}/together_grpo", "grpo", "low_contrast", "rollouts"),
    ("baseline (all anchors)", f"{_EST}/anchors_base", "trace_tree", "low_contrast", "tokens"),
    ("anchors before a tool call", f"{_EST}/anchors", "trace_tree", "low_contrast", "tokens"),
)
KEYS = ("em_curve_mean", "accuracy_final", "effective_ratio", "slice_auc", "slice_ece",
        "stage1_predicted_mixed", "stage1_posterior_mixed", "stage1_mixed", "clip_frac_last",
        "approx_kl_last", "generated_tokens", "prefill_tokens")

_OUT = flags.DEFINE_string("out", f"{_RES}/estimates/table", "output path without extension")
_SEEDS = flags.DEFINE_integer("seeds", 3, "seeds 0..seeds-1 of every arm")


def _mean(recs, key):
  vals = [r[key] for r in recs if isinstance(r.get(key), (int, float)) and np.isfinite(r[key])]
  return float(np.mean(vals)) if vals else None


def run_values(out_dir: str, row: dict) -> dict | None:
  """One run's values (`KEYS`) and its slice reliability bins, from its archived records."""
  recs = archived_records(out_dir, row["run"])
  if not recs:
    return None
  steps = [r for r in recs if "effective_ratio" in r]
  evals = [r["eval_em"] for r in recs if isinstance(r.get("eval_em"), (int, float))]
  last_slice = next((r for r in reversed(steps) if "slice_auc" in r), {})
  out = dict(seed=row["seed"], run=row["run"],
             em_curve_mean=float(np.mean(evals[1:])) if len(evals) > 1 else None,
             accuracy_final=row.get("accuracy_final"),
             effective_ratio=row.get("effective_ratio"),
             slice_auc=last_slice.get("slice_auc"), slice_ece=last_slice.get("slice_ece"),
             stage1_predicted_mixed=_mean(steps, "stage1_predicted_mixed"),
             stage1_posterior_mixed=_mean(steps, "stage1_posterior_mixed"),
             stage1_mixed=_mean(steps, "stage1_mixed"),
             clip_frac_last=_mean(steps, "clip_frac_last"),
             approx_kl_last=_mean(steps, "approx_kl_last"),
             generated_tokens=row.get("generated_tokens"),
             prefill_tokens=row.get("prefill_tokens"))
  bins = [(last_slice.get(f"slice_calib{b}_n"), last_slice.get(f"slice_calib{b}_pred"),
           last_slice.get(f"slice_calib{b}_outcome")) for b in range(5)]
  # An empty bin (or one with no record) carries no weight.
  out["bins"] = [b if all(isinstance(x, (int, float)) and np.isfinite(x) for x in b)
                 else (0.0, 0.0, 0.0) for b in bins]
  return out


def archived_rows(out_dir, method, regime, budget, seeds) -> list[dict]:
  """Rows of the arm's finished runs, from their archived summaries (so an arm whose campaign is
  still running, with no summary.json yet, shows the runs it has)."""
  rows = []
  for seed in range(seeds):
    run = f"{regime}/{budget}/{method}-seed{seed}"
    path = os.path.join(out_dir, "runs", run, "summary.json")
    if os.path.exists(path):
      with open(path) as f:
        s = json.load(f)
      rows.append(dict(s, run=run, seed=seed, regime=regime, budget=budget))
  return rows


def arm_values(label, out_dir, method, regime, budget, seeds) -> dict:
  rows = archived_rows(out_dir, method, regime, budget, seeds)
  runs = [v for v in (run_values(out_dir, r) for r in sorted(rows, key=lambda r: r["seed"]))
          if v is not None]
  arm = dict(label=label, dir=out_dir, method=method, regime=regime, budget=budget,
             seeds=[r["seed"] for r in runs], runs=runs)
  for k in KEYS:
    arm[k] = stats([r[k] for r in runs])
  pooled = []
  for b in range(5):  # pooled over seeds, weighted by each run's rollouts in the bin
    n = sum(r["bins"][b][0] or 0.0 for r in runs)
    if n > 0:
      pred = sum((r["bins"][b][0] or 0.0) * (r["bins"][b][1] or 0.0) for r in runs) / n
      obs = sum((r["bins"][b][0] or 0.0) * (r["bins"][b][2] or 0.0) for r in runs) / n
      pooled.append((n, pred, obs))
  arm["reliability"] = pooled
  total = sum(n for n, _, _ in pooled)
  arm["pooled_ece"] = (sum(n * abs(p - o) for n, p, o in pooled) / total) if total else None
  return arm


def markdown(arms) -> str:
  lines = ["# Issue 30: the estimates, each alone and together", "",
           "Mean ± std over seeds; Welch's t against the first arm of the same regime and budget "
           "(its baseline). EM over run: the mean held-out EM of the evaluations after step 0. "
           "Slice ECE: the run's last slice record (all its slice rollouts, 5 bins); pooled ECE "
           "pools the bins over the arm's seeds. Stage-1 mixed: expected (mean V_root of the "
           "counts and p̂ it allocated by) / realized; with a Beta objective, in parentheses, what "
           "the Beta expects (E[V_root]).", ""]
  for key in sorted({(a["regime"], a["budget"]) for a in arms}):
    group = [a for a in arms if (a["regime"], a["budget"]) == key]
    base = group[0]
    lines += [f"## {key[0]}, equal {key[1]}", "",
              "| arm | seeds | EM over run | EM final | effective ratio | slice AUC | slice ECE | "
              "pooled ECE | stage-1 mixed exp. / real. | clip frac | approx KL | gen. tokens | "
              "prefill tokens | EM over run vs baseline |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in group:
      w = welch([r["em_curve_mean"] for r in a["runs"]],
                [r["em_curve_mean"] for r in base["runs"]]) if a is not base else None
      mixed = (f"{fmt(a['stage1_predicted_mixed'])} / {fmt(a['stage1_mixed'])}"
               if a["stage1_predicted_mixed"] else f"- / {fmt(a['stage1_mixed'])}")
      if a["stage1_posterior_mixed"]:
        mixed += f" (Beta: {fmt(a['stage1_posterior_mixed'])})"
      ece = "-" if a["pooled_ece"] is None else f"{a['pooled_ece']:.3f}"
      tok = "-" if not a["generated_tokens"] else f"{a['generated_tokens']['mean']:.0f}"
      pre = "-" if not a["prefill_tokens"] else f"{a['prefill_tokens']['mean']:.0f}"
      lines.append(
          f"| {a['label']} | {len(a['seeds'])} | {fmt(a['em_curve_mean'])} | "
          f"{fmt(a['accuracy_final'])} | {fmt(a['effective_ratio'])} | {fmt(a['slice_auc'])} | "
          f"{fmt(a['slice_ece'])} | {ece} | {mixed} | {fmt(a['clip_frac_last'])} | "
          f"{fmt(a['approx_kl_last'], 4)} | {tok} | {pre} | "
          f"{'-' if w is None else fmt_welch(w)} |")
    lines.append("")
  missing = [f"{a['label']} ({a['regime']}, {a['budget']})" for a in arms if not a["runs"]]
  if missing:
    lines += ["Not run yet: " + ", ".join(missing) + ".", ""]
  return "\n".join(lines)


def plot(arms, path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  keys = sorted({(a["regime"], a["budget"]) for a in arms if a["runs"]})
  fig, axes = plt.subplots(2, max(len(keys), 1), figsize=(5.5 * max(len(keys), 1), 9),
                           squeeze=False)
  for j, key in enumerate(keys):
    group = [a for a in arms if (a["regime"], a["budget"]) == key and a["runs"]]
    ax = axes[0, j]
    ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
    for a in group:
      if a["reliability"]:
        ax.plot([p for _, p, _ in a["reliability"]], [o for _, _, o in a["reliability"]],
                marker="o", label=a["label"])
    ax.set(title=f"slice reliability: {key[0]}, {key[1]}", xlabel="mean p̂ in bin",
           ylabel="observed success", xlim=(0, 1), ylim=(0, 1))
    ax.legend(fontsize=7)
    ax = axes[1, j]
    ys = [a["em_curve_mean"]["mean"] if a["em_curve_mean"] else np.nan for a in group]
    es = [a["em_curve_mean"]["std"] if a["em_curve_mean"] else 0.0 for a in group]
    ax.bar(range(len(group)), ys, yerr=es, color="tab:blue", alpha=0.7)
    ax.set_xticks(range(len(group)), [a["label"] for a in group], rotation=35, ha="right",
                  fontsize=7)
    finite = [y for y in ys if np.isfinite(y)] or [0.0, 1.0]
    ax.set(title="mean held-out EM over the run", ylim=(min(finite) - 0.05, max(finite) + 0.03))
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv):
  del argv
  arms = [arm_values(*spec, _SEEDS.value) for spec in ARMS]
  os.makedirs(os.path.dirname(_OUT.value), exist_ok=True)
  with open(_OUT.value + ".md", "w") as f:
    f.write("Command: `python projects/mhqa/estimates_table.py`\n\n" + markdown(arms))
  with open(_OUT.value + ".json", "w") as f:
    json.dump({"arms": arms}, f, indent=1, default=float)
  plot(arms, _OUT.value + ".png")
  print(open(_OUT.value + ".md").read())


if __name__ == "__main__":
  app.run(main)
