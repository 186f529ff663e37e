"""Runs several methods with the same seed and rollout budget and compares them.

  python launch/compare.py --config=configs/mhqa.py --methods=trace_tree,trace,grpo

Each method trains from the same cached warm start (the first run creates it). Writes
`results/compare_<variant>.json` (every summary plus the wasted-group ratios) and
`results/compare_<variant>.png` (greedy held-out EM against RL step and against generated tokens,
effective ratio per method).
"""

import json
import os
import platform
import sys
import time

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.join(_ROOT, "configs"))

from absl import app, flags  # noqa: E402
from absl import logging as absl_logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", os.path.join(_ROOT, "configs", "mhqa.py"),
                                          "configs/mhqa.py[:variant]")
_METHODS = flags.DEFINE_string("methods", "trace_tree,trace,grpo", "comma-separated methods")
_OUT = flags.DEFINE_string("out", "results", "output directory")
_RUNS = flags.DEFINE_string("runs", "runs/compare", "parent directory of the run workdirs")


def _plot(summaries, records, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(1, 3, figsize=(15, 4))
  for m, recs in records.items():
    ev = [r for r in recs if "eval_em" in r]
    ax[0].plot([r["step"] for r in ev], [r["eval_em"] for r in ev], "o-", label=m)
    ax[1].plot([r["generated_tokens_total"] for r in ev], [r["eval_em"] for r in ev], "o-",
               label=m)
  ms = list(summaries)
  ax[2].bar(ms, [summaries[m]["effective_ratio"] for m in ms])
  if "grpo" in summaries:  # the effective ratio at which a method wastes half of grpo's groups
    ax[2].axhline(1 - 0.5 * (1 - summaries["grpo"]["effective_ratio"]), color="k", ls="--",
                  label="halves grpo's wasted groups")
    ax[2].legend(loc="lower right")
  ax[0].set(xlabel="RL step", ylabel="greedy held-out EM")
  ax[1].set(xlabel="generated tokens", ylabel="greedy held-out EM")
  ax[2].set(ylabel="effective ratio (mixed trees)", ylim=(0, 1))
  for a in ax[:2]:
    a.legend()
    a.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main(argv):
  del argv
  import mhqa
  import logging

  from trace_jax.metrics import read_jsonl
  from trace_jax.train import train

  logging.getLogger("bm25s").setLevel(logging.WARNING)
  absl_logging.set_verbosity(absl_logging.WARNING)
  base = _CONFIG.value
  summaries, records = {}, {}
  for m in _METHODS.value.split(","):
    c = base.copy_and_resolve_references()
    c.method = m
    c.workdir = os.path.join(_RUNS.value, f"{c.variant}-{m}-seed{c.seed}")
    s = train(c, validate_fn=mhqa.validate)
    summaries[m] = s
    records[m] = read_jsonl(os.path.join(c.workdir, "metrics.jsonl"))
  wasted = {m: 1.0 - s["effective_ratio"] for m, s in summaries.items()}
  out = dict(
      command="python launch/compare.py " + " ".join(sys.argv[1:]),
      machine=dict(platform=platform.platform(), cpu_count=os.cpu_count()),
      date=time.strftime("%Y-%m-%d %H:%M:%S"), budget_held_equal="rollouts per step",
      summaries=summaries, wasted_groups=wasted,
      wasted_ratio_vs_grpo={m: wasted[m] / wasted["grpo"] for m in wasted
                            if "grpo" in wasted and wasted["grpo"] > 0})
  os.makedirs(_OUT.value, exist_ok=True)
  stem = os.path.join(_OUT.value, f"compare_{base.variant}")
  with open(stem + ".json", "w") as f:
    json.dump(out, f, indent=1, default=str)
  _plot(summaries, records, stem + ".png")
  print(json.dumps({m: {k: s[k] for k in ("accuracy_start", "accuracy_final", "effective_ratio",
                                          "generated_tokens", "rollouts", "wall_seconds")}
                    for m, s in summaries.items()}, indent=1))


if __name__ == "__main__":
  app.run(main)
