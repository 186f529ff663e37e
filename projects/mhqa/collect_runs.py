"""Collects finished runs into one table: summary figures plus stage-1/stage-2 diagnostics.

  python projects/mhqa/collect_runs.py --runs=runs/exp --out=projects/mhqa/results/ablations_tiny

For every `<runs>/*/summary.json`: method, the config fields that differ between the runs, greedy
EM before/after, effective ratio, the share of mixed trees after stage 1 and what stage 1 expected
from p̂, generated tokens, and the predictor's allocation-time AUC at roots and at prefixes.
Writes <out>.json and prints a markdown table.
"""

import glob
import json
import os
import sys

from absl import app, flags

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")

_RUNS = flags.DEFINE_string("runs", "runs/exp", "parent directory of finished run workdirs")
_OUT = flags.DEFINE_string("out", "projects/mhqa/results/ablations_tiny", "output stem (.json)")


def _flatten(d, prefix=""):
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def _mean(rows, key):
  vals = [r[key] for r in rows if key in r]
  return sum(vals) / len(vals) if vals else None


def main(argv):
  del argv
  from trace_jax.metrics import read_jsonl

  runs = sorted(d for d in glob.glob(os.path.join(_RUNS.value, "*"))
                if os.path.exists(os.path.join(d, "summary.json")))
  if not runs:
    raise SystemExit(f"no finished runs (summary.json) under {_RUNS.value}")
  configs = {d: _flatten(json.load(open(os.path.join(d, "config.json")))) for d in runs}
  keys = sorted({k for c in configs.values() for k in c})
  differ = [k for k in keys if len({json.dumps(c.get(k)) for c in configs.values()}) > 1
            and k != "workdir"]
  table = []
  for d in runs:
    s = json.load(open(os.path.join(d, "summary.json")))
    steps = [r for r in read_jsonl(os.path.join(d, "metrics.jsonl")) if "effective_ratio" in r]
    pred = s.get("predictor", {})
    table.append(dict(
        run=os.path.basename(d), method=s["method"],
        settings={k: configs[d].get(k) for k in differ},
        accuracy_start=s["accuracy_start"], accuracy_final=s["accuracy_final"],
        effective_ratio=s["effective_ratio"], stage1_mixed=_mean(steps, "stage1_mixed"),
        stage1_predicted_mixed=_mean(steps, "stage1_predicted_mixed"),
        generated_tokens=s["generated_tokens"],
        root_auc=pred.get("root", {}).get("auc"), prefix_auc=pred.get("prefix", {}).get("auc")))
  with open(_OUT.value + ".json", "w") as f:
    json.dump(dict(command="python projects/mhqa/collect_runs.py " + " ".join(sys.argv[1:]),
                   varied=differ, runs=table), f, indent=1)
  fmt = lambda v: "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))
  cols = ["accuracy_final", "effective_ratio", "stage1_mixed", "stage1_predicted_mixed",
          "generated_tokens", "root_auc", "prefix_auc"]
  print("| run | method | " + " | ".join(cols) + " |")
  print("|---" * (len(cols) + 2) + "|")
  for r in table:
    print(f"| {r['run']} | {r['method']} | " + " | ".join(fmt(r[c]) for c in cols) + " |")
  print("varied:", ", ".join(differ))


if __name__ == "__main__":
  app.run(main)
