"""Tests for the host-side predictor quality metrics."""

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from trace_jax.allocation import predictor_metrics as pm


def _auc_pairwise(p, y):
  pos, neg = p[y >= 0.5], p[y < 0.5]
  wins = sum((a > b) + 0.5 * (a == b) for a in pos for b in neg)
  return wins / (len(pos) * len(neg))


@settings(deadline=None, max_examples=80, derandomize=True)
@given(data=st.lists(st.tuples(st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.7, 0.9, 1.0]),
                               st.sampled_from([0.0, 1.0])), min_size=1, max_size=30))
def test_auc_matches_pairwise_count_with_ties(data):
  p, y = (np.asarray(x) for x in zip(*data))
  got = pm.auc(p, y)
  if y.min() == y.max():
    assert math.isnan(got)
  else:
    np.testing.assert_allclose(got, _auc_pairwise(p, y), rtol=1e-12)


def test_auc_known_values():
  assert pm.auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == 0.75
  assert pm.auc([0.9, 0.8, 0.1], [1, 1, 0]) == 1.0
  assert pm.auc([0.5, 0.5, 0.5], [1, 0, 1]) == 0.5
  assert pm.auc([0.2, 0.9], [0.8, 0.3]) == 0.0  # Soft outcomes count as success at >= 0.5.


def test_brier():
  np.testing.assert_allclose(pm.brier([0.2, 0.9], [0, 1]), (0.04 + 0.01) / 2)
  assert math.isnan(pm.brier([], []))


def test_calibration_curve_and_ece():
  p = np.array([0.05, 0.05, 0.15, 0.95, 1.0])
  y = np.array([0.0, 1.0, 0.0, 1.0, 1.0])
  curve = pm.calibration_curve(p, y, n_bins=10)
  np.testing.assert_array_equal(curve["count"], [2, 1, 0, 0, 0, 0, 0, 0, 0, 2])
  np.testing.assert_allclose(curve["mean_outcome"][[0, 1, 9]], [0.5, 0.0, 1.0])
  np.testing.assert_allclose(curve["mean_pred"][[0, 1, 9]], [0.05, 0.15, 0.975])
  assert np.isnan(curve["mean_pred"][2])
  ece = (2 * 0.45 + 1 * 0.15 + 2 * 0.025) / 5
  np.testing.assert_allclose(pm.expected_calibration_error(p, y), ece)
  # A perfectly calibrated predictor has ECE 0.
  rng = np.random.default_rng(0)
  y = (rng.random(4000) < 0.3).astype(float)
  assert pm.expected_calibration_error(np.full(4000, y.mean()), y) < 1e-12


def test_predictor_report_against_constant_baseline():
  rng = np.random.default_rng(1)
  p_true = rng.random(2000)
  y = (rng.random(2000) < p_true).astype(float)
  rep = pm.predictor_report(p_true, y)
  assert rep["n"] == 2000 and 0.7 < rep["auc"] < 0.9
  assert rep["baseline_auc"] == 0.5 and rep["baseline_ece"] < 1e-12
  np.testing.assert_allclose(rep["baseline_brier"], y.mean() * (1 - y.mean()))
  assert rep["brier"] < rep["baseline_brier"] and rep["brier_skill"] > 0.1
  assert rep["ece"] < 0.06
  rep = pm.predictor_report([0.3, 0.6], [1.0, 1.0])
  assert math.isnan(rep["auc"]) and math.isnan(rep["brier_skill"])


def test_stratified_by_outcome():
  from trace_jax.allocation.predictor_metrics import stratified_by_outcome
  out = stratified_by_outcome([0.9, 0.7, 0.2, 0.4, 0.5], [1, 1, 0, 0, 0], prefix="s_")
  assert out["s_n_success"] == 2 and out["s_n_failure"] == 3
  assert out["s_p_success"] == pytest.approx(0.8) and out["s_p_failure"] == pytest.approx(11 / 30)
  assert out["s_p_gap"] == pytest.approx(0.8 - 11 / 30)
  assert out["s_brier_success"] == pytest.approx((0.01 + 0.09) / 2)
  empty = stratified_by_outcome([0.3], [0])
  assert np.isnan(empty["p_success"]) and np.isnan(empty["p_gap"]) and empty["n_success"] == 0
