"""Run metrics: JSONL + TensorBoard writers, the end-of-run plots and the summary table."""

from __future__ import annotations

import gzip
import json
import math
import os

import numpy as np

from trace_jax.checkpoint import jsonable


def _scalar_items(d: dict, prefix=""):
  for k, v in d.items():
    if isinstance(v, dict):
      yield from _scalar_items(v, f"{prefix}{k}/")
    elif isinstance(v, (int, float, np.integer, np.floating, bool)) and not isinstance(v, str):
      yield f"{prefix}{k}", float(v)


class MetricWriter:
  """Appends one JSON object per record to `metrics.jsonl` and scalars to TensorBoard events."""

  def __init__(self, workdir: str):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._f = open(self.path, "a")
    try:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(os.path.join(workdir, "tb"))
    except ImportError:  # TensorBoard events are optional; the JSONL is the record
      self._tb = None

  def write(self, step: int, record: dict) -> None:
    rec = {"step": int(step), **record}
    self._f.write(json.dumps(rec, default=_json_default) + "\n")
    self._f.flush()
    if self._tb is not None:
      for k, v in _scalar_items(record):
        if math.isfinite(v):
          self._tb.add_scalar(k, v, step)
      self._tb.flush()

  def truncate(self, last_step: int) -> int:
    """Drops records after `last_step` (see `truncate_jsonl`); later writes append after them."""
    self._f.close()
    dropped = truncate_jsonl(self.path, last_step)
    self._f = open(self.path, "a")
    return dropped

  def close(self):
    self._f.close()
    if self._tb is not None:
      self._tb.close()


def _json_default(x):
  out = jsonable(x)
  return str(x) if out is x else out


def read_jsonl(path: str) -> list[dict]:
  """Records of a JSONL file (gzipped when the name ends in .gz, as a campaign's archived runs
  are); a torn last line (a write cut by a crash) is skipped, not fatal."""
  out = []
  with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
    lines = [line for line in f if line.strip()]
  for i, line in enumerate(lines):
    try:
      out.append(json.loads(line))
    except json.JSONDecodeError:
      if i != len(lines) - 1:
        raise ValueError(f"{path}: line {i + 1} is not JSON (only a torn last line is repaired)")
  return out


def truncate_jsonl(path: str, last_step: int) -> int:
  """Keeps the records with `step <= last_step` (and drops a torn last line), rewriting the file
  atomically. A resumed run calls it with its checkpoint's step, so a step written after that
  checkpoint (the run died before the next one) is not recorded twice. Returns records dropped."""
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    n_lines = sum(1 for line in f if line.strip())
  keep = [r for r in read_jsonl(path) if int(r.get("step", 0)) <= last_step]
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.writelines(json.dumps(r, default=_json_default) + "\n" for r in keep)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
  return n_lines - len(keep)


def plot_run(workdir: str, records: list[dict], calibration: dict | None = None) -> list[str]:
  """Accuracy vs step and vs generated tokens, effective ratio, predictor calibration."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  evals = [r for r in records if "eval_em" in r]
  steps = [r for r in records if "effective_ratio" in r]
  paths = []
  fig, ax = plt.subplots(1, 3, figsize=(15, 4))
  if evals:
    ax[0].plot([r["step"] for r in evals], [r["eval_em"] for r in evals], "o-")
    ax[1].plot([r.get("generated_tokens_total", 0) for r in evals],
               [r["eval_em"] for r in evals], "o-")
  ax[0].set(xlabel="RL step", ylabel="greedy held-out EM", title="accuracy vs step")
  ax[1].set(xlabel="generated tokens (cumulative)", ylabel="greedy held-out EM",
            title="accuracy vs sampling cost")
  if steps:
    ax[2].plot([r["step"] for r in steps], [r["effective_ratio"] for r in steps],
               label="trained trees")
    ax[2].plot([r["step"] for r in steps], [r.get("stage1_mixed", np.nan) for r in steps],
               label="after stage 1")
    if any("stage1_predicted_mixed" in r for r in steps):  # what the root allocation expected
      ax[2].plot([r["step"] for r in steps],
                 [r.get("stage1_predicted_mixed", np.nan) for r in steps], "--",
                 label="stage 1 predicted by p̂")
    ax[2].set_ylim(0, 1)
    ax[2].legend()
  ax[2].set(xlabel="RL step", ylabel="share of mixed trees", title="effective ratio")
  for a in ax:
    a.grid(alpha=0.3)
  fig.tight_layout()
  p = os.path.join(workdir, "training_curves.png")
  fig.savefig(p, dpi=100)
  plt.close(fig)
  paths.append(p)
  if calibration and calibration.get("bins"):
    fig, a = plt.subplots(figsize=(4.5, 4.5))
    b = calibration["bins"]
    a.plot([0, 1], [0, 1], "k--", lw=1)
    a.plot(b["mean_pred"], b["mean_outcome"], "o-")
    a.set(xlabel="predicted success p̂ (at allocation)", ylabel="observed success",
          title=f"predictor calibration (ECE {calibration.get('ece', float('nan')):.3f})")
    a.grid(alpha=0.3)
    fig.tight_layout()
    p = os.path.join(workdir, "predictor_calibration.png")
    fig.savefig(p, dpi=100)
    plt.close(fig)
    paths.append(p)
  return paths


def format_summary(summary: dict) -> str:
  rows = [(k, v) for k, v in summary.items() if not isinstance(v, (dict, list))]
  w = max(len(k) for k, _ in rows)
  out = []
  for k, v in rows:
    out.append(f"{k:<{w}}  {v:.4f}" if isinstance(v, float) else f"{k:<{w}}  {v}")
  return "\n".join(out)
