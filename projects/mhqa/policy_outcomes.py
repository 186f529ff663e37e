"""Why greedy and sampled rollouts fail, warm start against trained policies, from the probes.

  python projects/mhqa/probe_warm_start.py --temperatures=0.8 --offline_fit=false \
      --out=projects/mhqa/results/policy_probe/warm_start.json
  python projects/mhqa/probe_warm_start.py --workdir=runs/compare/default/rollouts/trace-seed0 \
      --temperatures=0.8 --offline_fit=false \
      --out=projects/mhqa/results/policy_probe/trace-seed0.json
  python projects/mhqa/policy_outcomes.py --probes=projects/mhqa/results/policy_probe

Reads every probe JSON under --probes (the one without a policy is the warm start) and writes
outcomes.md (greedy outcome shares on the test split, sampled shares on train prompts, and how
each warm-start outcome of a test question turned out under each trained policy) and
outcomes.png (the shares as stacked bars).
"""

import collections
import glob
import json
import os

from absl import app, flags

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")

from trace_jax.diagnostics import FAILURE_KINDS  # noqa: E402

_PROBES = flags.DEFINE_string("probes", "projects/mhqa/results/policy_probe",
                              "directory of probe JSONs")
KINDS = ("success", *FAILURE_KINDS)


def load(directory):
  """{name: probe} with the warm start first (the probe of no training run)."""
  probes = {}
  for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
    with open(path) as f:
      d = json.load(f)
    if "greedy" in d and "outcomes" in d["greedy"]:
      probes[os.path.splitext(os.path.basename(path))[0]] = d
  if not probes:
    raise SystemExit(f"no probe JSON with outcomes under {directory}")
  warm = [k for k, d in probes.items() if not d.get("policy")]
  return {k: probes[k] for k in warm + [k for k in probes if k not in warm]}


def sampled(d):
  temps = d.get("temperatures", {})
  return next(iter(temps.values())) if temps else None


def transitions(before: dict, after: dict) -> dict:
  """{kind before: Counter(kind after)} over the questions both probes answered."""
  out = collections.defaultdict(collections.Counter)
  for q, k in before.items():
    if q in after:
      out[k][after[q]] += 1
  return out


def markdown(probes) -> str:
  names = list(probes)
  lines = ["Greedy rollouts on the test split (share of questions):", "",
           "| policy | EM | " + " | ".join(KINDS[1:]) + " |",
           "|---" * (len(KINDS) + 1) + "|"]
  for n in names:
    o = probes[n]["greedy"]["outcomes"]
    lines.append(f"| {n} | {o['success']:.3f} | " + " | ".join(f"{o[k]:.3f}" for k in KINDS[1:])
                 + " |")
  if all("by_seen" in probes[n]["greedy"] for n in names):
    lines += ["", "Greedy EM on the test questions whose entity appears in a train question "
              "(seen) or in none (unseen), and the unseen ones' wrong_entity share:", "",
              "| policy | EM seen | EM unseen | wrong_entity, unseen | questions seen / unseen |",
              "|---|---|---|---|---|"]
    for n in names:
      b = probes[n]["greedy"]["by_seen"]
      get = lambda k, f: b[k]["outcomes"][f] if k in b else float("nan")
      lines.append(f"| {n} | {get('seen', 'success'):.3f} | {get('unseen', 'success'):.3f} | "
                   f"{get('unseen', 'wrong_entity'):.3f} | "
                   f"{b.get('seen', {}).get('questions', 0)} / "
                   f"{b.get('unseen', {}).get('questions', 0)} |")
  lines += ["", "Sampled rollouts on train prompts (share of rollouts; mixed share of the groups "
            "of 8; share of trap-hop searches that surfaced the misleading passage):", "",
            "| policy | success | " + " | ".join(KINDS[1:]) + " | mixed | trap misled |",
            "|---" * (len(KINDS) + 3) + "|"]
  for n in names:
    s = sampled(probes[n])
    if s is None or "outcomes" not in s:
      continue
    o = s["outcomes"]
    lines.append(f"| {n} | {o['success']:.3f} | " + " | ".join(f"{o[k]:.3f}" for k in KINDS[1:])
                 + f" | {s['mixed_share']:.3f} | {s['share_bad']:.3f} |")
  warm = names[0]
  before = probes[warm]["greedy"].get("per_question")
  if before and not probes[warm].get("policy"):
    for n in names[1:]:
      after = probes[n]["greedy"].get("per_question")
      if not after:
        continue
      tr = transitions(before, after)
      lines += ["", f"Each test question's greedy outcome, {warm} (rows) -> {n} (columns):", "",
                "| | " + " | ".join(KINDS) + " | questions |", "|---" * (len(KINDS) + 2) + "|"]
      for k in KINDS:
        row = tr.get(k, collections.Counter())
        lines.append(f"| {k} | " + " | ".join(str(row[j]) for j in KINDS)
                     + f" | {sum(row.values())} |")
  return "\n".join(lines) + "\n"


def plot(probes, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  names = list(probes)
  fig, axes = plt.subplots(1, 2, figsize=(12, 0.5 * len(names) + 2.2), sharey=True)
  colors = dict(zip(KINDS, ("tab:green", "tab:gray", "tab:red", "tab:orange", "tab:olive",
                            "tab:purple"), strict=True))
  for ax, title, get in ((axes[0], "greedy, test split", lambda d: d["greedy"]["outcomes"]),
                         (axes[1], "sampled, train prompts",
                          lambda d: (sampled(d) or {}).get("outcomes"))):
    for i, n in enumerate(names):
      o, left = get(probes[n]), 0.0
      if not o:
        continue
      for k in KINDS:
        ax.barh(i, o[k], left=left, color=colors[k], label=k if i == 0 else None)
        left += o[k]
    ax.set_title(title)
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of rollouts")
  axes[0].set_yticks(range(len(names)), names)
  axes[0].invert_yaxis()
  handles, labels = axes[0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="lower center", ncol=len(KINDS), fontsize=8)
  fig.tight_layout(rect=(0, 0.06, 1, 1))  # room for the legend below the bars
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  probes = load(_PROBES.value)
  md = markdown(probes)
  with open(os.path.join(_PROBES.value, "outcomes.md"), "w") as f:
    f.write(md)
  plot(probes, os.path.join(_PROBES.value, "outcomes.png"))
  print(md)


if __name__ == "__main__":
  app.run(main)
