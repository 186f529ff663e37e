"""One table over several `launch/compare.py` summaries: arms from different directories side by
side, each against a reference arm over seeds (Welch's t), with the held-out EM curve drawn.

  python projects/mhqa/results_table.py \
    --arm="projects/mhqa/results/compare_trap09:grpo:grpo" \
    --arm="projects/mhqa/results/compare_trap09_hard:trace_tree:trace_tree, 8 hard slots" \
    --reference="grpo" --eval_steps=8,10,12,16 --table_out=projects/mhqa/results/trap_world_table

Each `--arm` is `DIR:METHOD:LABEL`: the runs of METHOD (in `--regime` and `--budget`) in
`DIR/summary.json`, shown as LABEL; `--reference` names the label the others are compared with.
The held-out EM at `--eval_steps` comes from each run's archived records
(`DIR/runs/<run>/metrics.jsonl.gz`); a run without them leaves those cells to the others.
Writes `<table_out>.md` (its command, then the table), `<table_out>.json` (per arm: the per-seed
values, their mean and spread, the Welch comparisons with the reference for the mean EM over the
run, the final EM, the effective ratio, the generated tokens, the sampled trap-hop share and the
EM at each listed step, and the arm's wasted groups
as a share of the reference's, (1 − ER) / (1 − ER_ref)) and `<table_out>.png` (mean held-out EM by
step with a band of one std over seeds, one line per arm).
"""

from __future__ import annotations

import json
import os
import shlex
import sys

import numpy as np
from absl import app, flags

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")

from launch.campaign import archived_records, summary_rows  # noqa: E402
from launch.seed_stats import fmt, fmt_welch, stats, wasted_ratio, welch  # noqa: E402

RUN_KEYS = ("accuracy_final", "em_curve_mean", "effective_ratio", "mixed_groups",
            "generated_tokens", "slice_auc", "em_half_gain_step", "sampled_trap_share")
COMPARED = ("em_curve_mean", "accuracy_final", "effective_ratio", "generated_tokens",
            "sampled_trap_share")


def parse_arm(spec: str) -> dict:
  """`DIR:METHOD:LABEL` (the label may hold colons) -> {dir, method, label}."""
  parts = spec.split(":", 2)
  if len(parts) != 3 or not all(p.strip() for p in parts):
    raise ValueError(f"--arm={spec!r}: expected DIR:METHOD:LABEL")
  return dict(dir=parts[0], method=parts[1], label=parts[2])


def eval_curve(recs: list[dict] | None) -> dict[int, float]:
  """{step: held-out EM} of one run's per-step records; {} without them."""
  return {int(r["step"]): float(r["eval_em"]) for r in recs or ()
          if isinstance(r.get("eval_em"), (int, float)) and r.get("step") is not None}


def load_arm(arm: dict, regime: str = "default", budget: str = "rollouts") -> dict:
  """The arm's runs from its summary: per seed, the summary figures and the EM curve."""
  runs = sorted((r for r in summary_rows(arm["dir"]) if r.get("method") == arm["method"]
                 and r.get("regime", "default") == regime
                 and r.get("budget", "rollouts") == budget), key=lambda r: r.get("seed", 0))
  if not runs:
    raise ValueError(f"{arm['dir']} has no {arm['method']} run in regime {regime}, budget {budget}")
  for r in runs:
    r["curve"] = eval_curve(archived_records(arm["dir"], r["run"]))
  return dict(arm, runs=runs)


def summarize(arms: list[dict], reference: str, eval_steps: list[int]) -> list[dict]:
  """Per arm: seeds, the mean and spread of each figure and of the EM at each step, and the Welch
  comparisons with the reference arm (none for the reference itself)."""
  by_label = {a["label"]: a for a in arms}
  if len(by_label) != len(arms):
    raise ValueError(f"arm labels must differ: {[a['label'] for a in arms]}")
  if reference not in by_label:
    raise ValueError(f"--reference={reference!r} is none of the arms' labels {list(by_label)}")

  def values(a, key):
    if isinstance(key, int):
      return [r["curve"].get(key) for r in a["runs"]]
    return [r.get(key) for r in a["runs"]]

  ref = by_label[reference]
  out = []
  for a in arms:
    row = dict(label=a["label"], dir=a["dir"], method=a["method"],
               seeds=[r.get("seed") for r in a["runs"]],
               half_gain_steps=[r.get("em_half_gain_step") for r in a["runs"]],
               stats={k: stats(values(a, k)) for k in RUN_KEYS},
               em_at_step={s: stats(values(a, s)) for s in eval_steps})
    if a is not ref:
      er, ref_er = row["stats"]["effective_ratio"], stats(values(ref, "effective_ratio"))
      row["wasted_vs_reference"] = wasted_ratio(er and er["mean"], ref_er and ref_er["mean"])
      row["vs_reference"] = {k: welch(values(a, k), values(ref, k)) for k in COMPARED}
      row["vs_reference"].update({f"em_step{s}": welch(values(a, s), values(ref, s))
                                  for s in eval_steps})
    out.append(row)
  return out


def _em_cell(st, seeds: int) -> str:
  """An EM-at-step cell; `(n=k)` when fewer runs than the arm's seeds have that evaluation
  archived."""
  if st is None or st["n"] == seeds:
    return fmt(st)
  return f"{fmt(st)} (n={st['n']})"


def markdown(rows: list[dict], reference: str, eval_steps: list[int]) -> str:
  head = (["arm", "seeds"] + [f"EM step {s}" for s in eval_steps] +
          ["mean EM over the run", f"vs {reference} (Welch t, df, p)", "effective ratio",
           f"1 − ER / {reference}'s", "mixed groups / step", "generated tokens", "slice AUC",
           "step of half the EM gain, per seed"])
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in rows:
    st = r["stats"]
    tok = st["generated_tokens"]
    n = len(r["seeds"])
    cells = ([r["label"].replace("|", "\\|"), str(n)] +
             [_em_cell(r["em_at_step"][s], n) for s in eval_steps] +
             [fmt(st["em_curve_mean"]),
              fmt_welch((r.get("vs_reference") or {}).get("em_curve_mean")),
              fmt(st["effective_ratio"]),
              "-" if r.get("wasted_vs_reference") is None else f"{r['wasted_vs_reference']:.2f}",
              fmt(st["mixed_groups"], 1),
              "-" if tok is None else f"{tok['mean'] / 1e3:.0f}k", fmt(st["slice_auc"]),
              ", ".join("-" if x is None else str(x) for x in r["half_gain_steps"])])
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def plot(arms: list[dict], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(8, 4.2 + 0.22 * len(arms)))
  for a in arms:
    steps = sorted({s for r in a["runs"] for s in r["curve"]})
    if not steps:
      continue
    per = [stats([r["curve"].get(s) for r in a["runs"]]) for s in steps]
    mean = np.array([st["mean"] for st in per])
    std = np.array([st["std"] for st in per])
    label = a["label"].replace("$", r"\$")  # no mathtext in a label
    line, = ax.plot(steps, mean, marker="o", ms=3, label=f"{label} ({len(a['runs'])})")
    ax.fill_between(steps, mean - std, mean + std, color=line.get_color(), alpha=0.08)
  ax.set(xlabel="RL step", ylabel="held-out EM (greedy)",
         title="mean over the seeds with records, band: one std (runs in parentheses)")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1, frameon=False)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)


def main(argv):
  del argv
  arms = [load_arm(parse_arm(s), _REGIME.value, _BUDGET.value) for s in _ARMS.value]
  steps = [int(s) for s in _STEPS.value.split(",") if s]
  rows = summarize(arms, _REFERENCE.value, steps)
  md = markdown(rows, _REFERENCE.value, steps)
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  command = "python projects/mhqa/results_table.py " + shlex.join(sys.argv[1:])
  with open(_OUT.value + ".md", "w") as f:
    f.write(f"Command:\n\n```sh\n{command}\n```\n\n"
            f"Mean ± sample std over seeds; vs {_REFERENCE.value}: the "
            "difference in mean held-out EM over the run (the evaluations after step 0), Welch's "
            "t over seeds, its degrees of freedom and two-sided p (each arm against the same "
            "reference: with many arms, one small p can be chance).\n\n" + md)
  with open(_OUT.value + ".json", "w") as f:
    json.dump(dict(command=command, regime=_REGIME.value, budget=_BUDGET.value,
                   reference=_REFERENCE.value, eval_steps=steps, arms=rows), f, indent=1)
  plot(arms, _OUT.value + ".png")
  print(md, flush=True)


if __name__ == "__main__":
  # Defined only when run as a script, like trap_discovery.py: the tests import these modules
  # side by side, and absl's flag registry is global.
  _ARMS = flags.DEFINE_multi_string("arm", None, "DIR:METHOD:LABEL, once per arm")
  _REFERENCE = flags.DEFINE_string("reference", "grpo",
                                   "the label the other arms are compared with")
  _REGIME = flags.DEFINE_string("regime", "default", "regime of the runs to read")
  _BUDGET = flags.DEFINE_string("budget", "rollouts", "budget mode of the runs to read")
  _STEPS = flags.DEFINE_string("eval_steps", "8,10,12,16", "steps whose held-out EM is shown")
  _OUT = flags.DEFINE_string("table_out", "projects/mhqa/results/results_table",
                             "output path without extension (.md, .json, .png)")
  flags.mark_flag_as_required("arm")
  app.run(main)
