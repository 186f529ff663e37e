"""Does more contrast per step go with faster learning? Every archived run of some campaigns.

TRACE's allocation maximizes mixed groups per step; the premise is that contrast limits learning.
This reads the runs of `launch/compare.py` output directories (their `summary.json` rows, one row
per run: a method without a stage 2 serves both budget modes with one run, counted once) and,
within each group of directories that share a world and a run length, rank-correlates the mean
held-out EM over the run (`em_curve_mean`, the area under the learning curve) with the step's
contrast (mixed groups per step over the run, and over the first `--first_steps` steps), its cost
(generated tokens) and, where the runs log it, the share of sampled prompts with a trap hop in the
first steps. A run's contrast over the whole run is partly an effect of its learning (a policy
that learned the lesson sits nearer p = 0.5 on more prompts, so more of its groups are mixed);
the first steps' contrast comes before most of the learning, so it reads the other direction, from
contrast to learning. Three readings of each:

  pooled        every run of the group (methods and seeds together);
  across arms   the arms' means (an arm: one method in one directory and budget mode, 2+ runs),
                which asks whether an allocation with more contrast learns faster;
  within arms   each run's difference from its arm's mean, which asks whether a seed that happened
                to get more contrast learned faster than its arm's other seeds (its p counts one
                degree of freedom fewer per arm).

The p values take the runs as independent. They are not quite: arms that share a seed share
whatever that seed draws in common (its prompts, and with the same stage 1 its first allocation),
so a seed effect can show in several arms at once; read small p as an upper bound on the evidence.
Up to 8 points (often the across-arm reading) the p is exact over all orderings.

  python projects/mhqa/contrast_vs_learning.py \\
    --group="default world, 12 steps=projects/mhqa/results/compare_early,\\
projects/mhqa/results/compare_early_hard" \\
    --group="trap world, 16 steps=projects/mhqa/results/compare_trap09,\\
projects/mhqa/results/compare_trap09_hard"

Writes --out.json (the command, per group the runs and the correlations), --out.md and --out.png
(mean EM over the run against mixed groups per step, one panel per group).
"""

from __future__ import annotations

import fnmatch
import json
import os
import shlex
import sys

import numpy as np
from absl import app, flags

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")

from launch.campaign import archived_records, unique_runs  # noqa: E402
from launch.seed_stats import is_finite, spearman_test  # noqa: E402

TARGET = "em_curve_mean"
FACTORS = (("mixed_groups", "mixed groups / step, whole run"),
           ("early_mixed_groups", "mixed groups / step, first steps"),
           ("generated_tokens", "generated tokens"),
           ("early_trap_share", "sampled trap-hop share, first steps"))


def parse_group(spec: str) -> tuple[str, list[str]]:
  """`LABEL=DIR,DIR,...` -> (label, dirs)."""
  label, sep, dirs = spec.rpartition("=")
  dirs = [d for d in dirs.split(",") if d.strip()]
  if not sep or not label.strip() or not dirs:
    raise ValueError(f"--group={spec!r}: expected LABEL=DIR[,DIR...]")
  return label, dirs


def early(recs: list[dict] | None, prompts: float | None, first_steps: int) -> dict:
  """Mixed groups per step (effective ratio x prompts) and the sampled trap-hop share, each the
  mean over the steps 1..first_steps that log it; None where no step does."""
  steps = [r for r in recs or () if 1 <= (r.get("step") or 0) <= first_steps]
  ers = [r["effective_ratio"] for r in steps if is_finite(r.get("effective_ratio"))]
  trap = [r["sampled_trap_share"] for r in steps if is_finite(r.get("sampled_trap_share"))]
  return dict(early_mixed_groups=float(np.mean(ers)) * prompts if ers and prompts else None,
              early_trap_share=float(np.mean(trap)) if trap else None)


def selected(name: str, run: str, method: str, methods=(), exclude=()) -> bool:
  """Whether a run is read: its method among `methods` (all when empty) and `<dir name>/<run>`
  (e.g. `compare_early/default/rollouts/trace-seed3`) matching none of the `exclude` patterns
  (shell wildcards: `*/trace*-seed[34]`)."""
  if methods and method not in methods:
    return False
  return not any(fnmatch.fnmatchcase(f"{name}/{run}", pat) for pat in exclude)


def group_runs(dirs: list[str], first_steps: int, methods=(), exclude=()) -> list[dict]:
  """One entry per run of the directories (a run listed under two budget modes counted once),
  with its arm (`<dir>:<method>:<budget its run used>`); runs without a mean EM over the run, and
  runs `selected` leaves out, are left out. The first steps' figures come from the run's archived
  records."""
  out = []
  for d in dict.fromkeys(os.path.normpath(os.path.abspath(d)) for d in dirs):  # each dir once
    name = os.path.basename(d)
    for r in unique_runs(d):
      run = r.get("run") or f"{r.get('regime')}/{r.get('budget')}/{r['method']}-seed{r['seed']}"
      if not is_finite(r.get(TARGET)) or not selected(name, run, r["method"], methods, exclude):
        continue
      parts = run.split("/")
      budget = parts[1] if len(parts) == 3 else r.get("budget", "rollouts")
      row = dict(dir=name, run=run, method=r["method"], seed=r.get("seed"),
                 arm=f"{name}:{r['method']}:{budget}", **{TARGET: float(r[TARGET])},
                 **{k: (float(r[k]) if is_finite(r.get(k)) else None) for k, _ in FACTORS})
      prompts = r.get("prompts_per_step")
      row.update(early(archived_records(d, run), float(prompts) if is_finite(prompts) else None,
                       first_steps))
      out.append(row)
  return out


def correlate(runs: list[dict]) -> dict:
  """Per factor: pooled, across-arm and within-arm rank correlations with the mean EM."""
  out = {}
  for key, _ in FACTORS:
    ok = [r for r in runs if r[key] is not None]
    arms = {}
    for r in ok:
      arms.setdefault(r["arm"], []).append(r)
    multi = {a: rs for a, rs in arms.items() if len(rs) >= 2}
    arm_x = [float(np.mean([r[key] for r in rs])) for rs in multi.values()]
    arm_y = [float(np.mean([r[TARGET] for r in rs])) for rs in multi.values()]
    within_x, within_y = [], []
    for rs, mx, my in zip(multi.values(), arm_x, arm_y):
      within_x += [r[key] - mx for r in rs]
      within_y += [r[TARGET] - my for r in rs]
    out[key] = dict(pooled=spearman_test([r[key] for r in ok], [r[TARGET] for r in ok]),
                    across_arms=spearman_test(arm_x, arm_y),
                    within_arms=spearman_test(within_x, within_y, fitted=len(multi)),
                    arms=len(multi))
  return out


def _cell(c) -> str:
  return "-" if not c else f"{c['rho']:+.2f} (p {c['p']:.2g}, n {c['n']})"


def _steps(first_steps: int) -> str:
  return "RL step 1, before any update" if first_steps == 1 else f"RL steps 1 to {first_steps}"


def markdown(groups: list[dict], command: str, first_steps: int) -> str:
  lines = ["Command:", "", "```sh", command, "```", "",
           "Rank correlation (Spearman rho, two-sided p, number of points) of each factor with "
           "the mean held-out EM over the run (the area under the learning curve); the first "
           f"steps are {_steps(first_steps)}. Pooled: every "
           "run; across arms: the arms' means (arms of 2+ runs); within arms: each run's "
           "difference from its arm's mean (one degree of freedom fewer per arm). Up to 8 points "
           "the p is exact. The p values take the runs as independent; arms that share a seed "
           "share what that seed draws, so small p overstate the evidence.", ""]
  for g in groups:
    lines += [f"### {g['label']} ({len(g['runs'])} runs: {', '.join(g['dirs'])})", "",
              "| factor | pooled | across arms | within arms |", "|---|---|---|---|"]
    for key, what in FACTORS:
      c = g["correlations"][key]
      lines.append(f"| {what} | {_cell(c['pooled'])} | {_cell(c['across_arms'])} | "
                   f"{_cell(c['within_arms'])} |")
    lines.append("")
  return "\n".join(lines)


def plot(groups: list[dict], path: str) -> None:
  """Mean EM over the run against mixed groups per step: the first steps (top), the whole run
  (bottom); one column per group, one colour per arm."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(2, len(groups), figsize=(5.2 * len(groups), 8.4), squeeze=False)
  cmap = plt.get_cmap("tab20")
  for col, g in enumerate(groups):
    arms = sorted({r["arm"] for r in g["runs"]})
    for ax, key, what in ((axes[0][col], "early_mixed_groups", "first steps"),
                          (axes[1][col], "mixed_groups", "whole run")):
      for i, arm in enumerate(arms):
        pts = [r for r in g["runs"] if r["arm"] == arm and r[key] is not None]
        if pts:
          ax.scatter([r[key] for r in pts], [r[TARGET] for r in pts], s=22,
                     color=cmap(i % 20), label=arm)
      c = g["correlations"][key]
      ax.set(xlabel=f"mixed groups per step, {what}", ylabel="mean held-out EM over the run",
             title=f"{g['label']}\npooled {_cell(c['pooled'])}\nwithin arms "
                   f"{_cell(c['within_arms'])}")
      ax.grid(alpha=0.3)
    axes[1][col].legend(fontsize=5, ncol=1 if len(arms) < 12 else 2)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)


def main(argv):
  del argv
  if not _GROUPS.value:
    raise SystemExit("give at least one --group=LABEL=DIR[,DIR...]")
  groups = []
  for spec in _GROUPS.value:
    label, dirs = parse_group(spec)
    runs = group_runs(dirs, _FIRST.value, _METHODS.value or (), _EXCLUDE.value)
    if len(runs) < 3:
      raise SystemExit(f"group {label!r}: {len(runs)} runs with a mean EM over the run; "
                       "need at least 3")
    groups.append(dict(label=label, dirs=dirs, runs=runs, correlations=correlate(runs)))
  command = "python projects/mhqa/contrast_vs_learning.py " + shlex.join(sys.argv[1:])
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  with open(_OUT.value + ".json", "w") as f:
    json.dump(dict(command=command, target=TARGET, first_steps=_FIRST.value, groups=groups), f,
              indent=1)
  with open(_OUT.value + ".md", "w") as f:
    f.write(markdown(groups, command, _FIRST.value) + "\n")
  plot(groups, _OUT.value + ".png")
  print(markdown(groups, command, _FIRST.value))


if __name__ == "__main__":
  _GROUPS = flags.DEFINE_multi_string("group", [], "LABEL=DIR[,DIR...]: compare.py output "
                                      "directories of one world and run length")
  _FIRST = flags.DEFINE_integer("first_steps", 1, "RL steps 1..first_steps are the 'first "
                                "steps' (1: the one step sampled before any update, so its "
                                "contrast is allocation and chance, not learning)")
  _METHODS = flags.DEFINE_list("methods", [], "read only these methods' runs (default: all)")
  _EXCLUDE = flags.DEFINE_multi_string("exclude", [], "leave out the runs whose "
                                       "`<dir name>/<run>` matches this shell pattern, e.g. "
                                       "'*/trace*-seed[34]'")
  _OUT = flags.DEFINE_string("out", "projects/mhqa/results/contrast_vs_learning",
                              "output path without suffix")
  app.run(main)
