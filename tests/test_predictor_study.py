"""projects/lessons/predictor_study.py: the exact mixed-share estimate stage 1 is scored by."""

import math
import os
import sys

import numpy as np
import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "projects", "lessons"))

import predictor_study as ps  # noqa: E402


@pytest.mark.parametrize("p", [0.03, 0.3, 0.5, 0.9])
@pytest.mark.parametrize("m", [2, 5, 12])
def test_mixed_prob_is_unbiased_for_fresh_groups(p, m):
  n = 12  # E over k ~ Binomial(n, p) of the estimate is P(m fresh rollouts are mixed)
  k = np.arange(n + 1)
  weights = np.array([math.comb(n, int(j)) * p ** j * (1 - p) ** (n - j) for j in k])
  expect = float(np.sum(weights * ps.mixed_prob(k, n, np.full(n + 1, m))))
  assert expect == pytest.approx(1 - p ** m - (1 - p) ** m, abs=1e-12)


def test_mixed_prob_edges():
  # All fail or all succeed: never mixed; one success in 12, pairs drawn: 11 of 66 pairs hold it.
  assert ps.mixed_prob([0, 12], 12, [6, 6]).tolist() == [0.0, 0.0]
  assert ps.mixed_prob(1, 12, 2) == pytest.approx(11 / 66)
  assert ps.mixed_prob(5, 12, 0) == 0.0  # a prompt given no rollouts


def test_knn_predict_reads_the_nearest_fit_prompts():
  # Two clusters of directions; fit rates 1.0 in the first, 0.0 in the second.
  rng = np.random.default_rng(0)
  centres = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
  fit = np.concatenate([centres[0] + 0.05 * rng.normal(size=(6, 3)),
                        centres[1] + 0.05 * rng.normal(size=(6, 3))])
  rates = np.r_[np.ones(6), np.zeros(6)]
  test = np.array([[3.0, 0.1, 0.0], [0.1, 0.2, 0.0]])  # the scale must not matter (cosine)
  p, near = ps.knn_predict(fit, rates, test, 4, prior=0.5, strength=2.0)
  assert p.tolist() == pytest.approx([(4 + 1) / 6, (0 + 1) / 6])
  assert set(near[0]) <= set(range(6)) and set(near[1]) <= set(range(6, 12))
  purity, chance = ps.neighbour_purity(near, np.r_[np.zeros(6), np.ones(6)], np.array([0, 1]))
  assert (purity, chance) == (1.0, 0.5)
  with pytest.raises(ValueError, match="k=13"):
    ps.knn_predict(fit, rates, test, 13, prior=0.5)
