"""Host-side quality metrics of the success predictor (NumPy).

Meant for predictions made at allocation time against the outcomes that followed: `p` are predicted
success probabilities, `y` the observed outcomes in [0, 1] (a leaf's reward or a node's V). Brier
and calibration use `y` as is; AUC needs classes and counts y >= 0.5 as a success.
"""

from __future__ import annotations

import numpy as np


def _as_arrays(p, y):
  p = np.asarray(p, np.float64).reshape(-1)
  y = np.asarray(y, np.float64).reshape(-1)
  if p.shape != y.shape:
    raise ValueError(f"p and y must have the same size, got {p.shape} and {y.shape}")
  return p, y


def brier(p, y) -> float:
  """Mean squared error between predictions and outcomes; NaN when empty."""
  p, y = _as_arrays(p, y)
  return float(np.mean((p - y) ** 2)) if p.size else float("nan")


def auc(p, y) -> float:
  """Area under the ROC curve via the Mann-Whitney U statistic, ties counted as one half.

  Uses average ranks, O(n log n). NaN when either class is missing.
  """
  p, y = _as_arrays(p, y)
  pos = y >= 0.5
  n_pos, n_neg = int(pos.sum()), int((~pos).sum())
  if n_pos == 0 or n_neg == 0:
    return float("nan")
  order = np.argsort(p, kind="mergesort")
  sorted_p = p[order]
  ranks = np.empty(p.size, np.float64)
  # Average rank within each run of tied scores gives ties half credit.
  _, first, counts = np.unique(sorted_p, return_index=True, return_counts=True)
  avg = first + (counts + 1) / 2.0
  ranks[order] = np.repeat(avg, counts)
  u = ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0
  return float(u / (n_pos * n_neg))


def calibration_curve(p, y, n_bins: int = 10):
  """Reliability diagram data over equal-width bins of [0, 1].

  Returns:
    dict of f64[n_bins] arrays: bin_lower, bin_upper, mean_pred, mean_outcome (NaN in empty bins),
    count.
  """
  p, y = _as_arrays(p, y)
  edges = np.linspace(0.0, 1.0, n_bins + 1)
  # The last bin is closed so p == 1 lands in it.
  idx = np.clip(np.searchsorted(edges, p, side="right") - 1, 0, n_bins - 1)
  count = np.bincount(idx, minlength=n_bins).astype(np.float64)
  with np.errstate(invalid="ignore", divide="ignore"):
    mean_pred = np.bincount(idx, weights=p, minlength=n_bins) / count
    mean_outcome = np.bincount(idx, weights=y, minlength=n_bins) / count
  return {"bin_lower": edges[:-1], "bin_upper": edges[1:], "mean_pred": mean_pred,
          "mean_outcome": mean_outcome, "count": count}


def expected_calibration_error(p, y, n_bins: int = 10) -> float:
  """sum_b (n_b / n) |mean_pred_b - mean_outcome_b| over equal-width bins; NaN when empty."""
  curve = calibration_curve(p, y, n_bins)
  count = curve["count"]
  total = count.sum()
  if total == 0:
    return float("nan")
  gap = np.abs(curve["mean_pred"] - curve["mean_outcome"])
  return float(np.sum(np.where(count > 0, gap * count, 0.0)) / total)


def predictor_report(p, y, n_bins: int = 10) -> dict:
  """The predictor's metrics next to those of a constant prediction equal to mean(y).

  The constant baseline knows the realized base rate, so it is a hard reference for Brier: a
  predictor worth using has brier_skill = 1 - brier / baseline_brier > 0.

  Returns:
    dict of floats: n, mean_pred, mean_outcome, brier, auc, ece, baseline_brier, baseline_auc,
    baseline_ece, brier_skill.
  """
  p, y = _as_arrays(p, y)
  base = np.full_like(y, y.mean() if y.size else np.nan)
  report = {
      "n": float(p.size),
      "mean_pred": float(p.mean()) if p.size else float("nan"),
      "mean_outcome": float(y.mean()) if y.size else float("nan"),
      "brier": brier(p, y),
      "auc": auc(p, y),
      "ece": expected_calibration_error(p, y, n_bins),
      "baseline_brier": brier(base, y),
      "baseline_auc": auc(base, y),
      "baseline_ece": expected_calibration_error(base, y, n_bins),
  }
  b0 = report["baseline_brier"]
  report["brier_skill"] = 1.0 - report["brier"] / b0 if b0 > 0 else float("nan")
  return report


def stratified_by_outcome(p, y, prefix: str = "") -> dict:
  """p̂ within each outcome class (y >= 0.5 success, else failure): counts, mean p̂ and Brier per
  class, and their gap. The pooled metrics mix the classes by their base rate; per class, a
  predictor that says 0.5 everywhere shows a gap of 0 whatever the base rate.

  Returns:
    dict of floats: {prefix}n_success, n_failure, p_success (mean p̂ over successes), p_failure,
    brier_success, brier_failure, p_gap = p_success - p_failure (NaN for an empty class).
  """
  p, y = _as_arrays(p, y)
  pos = y >= 0.5
  out = {}
  for name, sel in (("success", pos), ("failure", ~pos)):
    out[f"{prefix}n_{name}"] = float(sel.sum())
    out[f"{prefix}p_{name}"] = float(p[sel].mean()) if sel.any() else float("nan")
    out[f"{prefix}brier_{name}"] = brier(p[sel], y[sel])
  out[f"{prefix}p_gap"] = out[f"{prefix}p_success"] - out[f"{prefix}p_failure"]
  return out


def prediction_summary(predictions) -> tuple[dict, dict | None]:
  """A run's allocation-time predictions, (stage, p̂, outcome) triples, as the summary reports
  them: (`predictor_report` over all, with a "root" and a "prefix" entry for each stage that has
  more than one; the calibration curve's bins and ECE for the plot), or ({}, None) when empty."""
  pred_rep, calib = {}, None
  if predictions:
    p = np.asarray([x[1] for x in predictions])
    y = np.asarray([x[2] for x in predictions])
    pred_rep = predictor_report(p, y)
    stage = np.asarray([x[0] for x in predictions])
    for st in ("root", "prefix"):  # stage 1 and stage 2 read different prefixes; report each
      if (stage == st).sum() > 1:
        pred_rep[st] = predictor_report(p[stage == st], y[stage == st])
    cc = calibration_curve(p, y)
    calib = {"bins": {k: np.asarray(v).tolist() for k, v in cc.items()}, "ece": pred_rep["ece"]}
  return pred_rep, calib
