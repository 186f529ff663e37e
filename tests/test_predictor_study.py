"""projects/lessons/predictor_study.py: the exact mixed-share estimate stage 1 is scored by."""

import math
import os

import numpy as np
import pytest

from projects.lessons import predictor_study as ps

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


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


def test_implied_concentration_recovers_a_beta_spread():
  # Prompts' rates drawn from Beta(κ p̂, κ (1 - p̂)) about a known p̂, 12 samples each: the pooled
  # estimate comes back near κ; a p̂ equal to each prompt's rate gives a very large κ.
  rng = np.random.default_rng(0)
  n, kappa = 12, 3.0
  p_hat = rng.uniform(0.2, 0.8, size=20000)
  rate = rng.beta(kappa * p_hat, kappa * (1 - p_hat))
  k = rng.binomial(n, rate)
  assert ps.implied_concentration(p_hat, k, n) == pytest.approx(kappa, rel=0.08)
  exact = rng.binomial(n, p_hat)
  assert ps.implied_concentration(p_hat, exact, n) > 50


def test_score_ranks_an_informed_predictor_above_a_constant_one():
  from types import SimpleNamespace

  c = SimpleNamespace(rollout=SimpleNamespace(candidate_prompts=12, prompts_per_step=4,
                                              root_budget=16, min_per_prompt=2, max_per_prompt=6))
  rng = np.random.default_rng(1)
  n = 12
  rate = rng.choice([0.02, 0.5, 0.98], size=60)  # a third of the prompts are coin flips
  k = rng.binomial(n, rate)
  own = ps.score(k / n, k, n, 0, 40, c)
  flat = ps.score(np.full(60, 0.5), k, n, 0, 40, c)
  assert own["selected_trees_mixed"] > flat["selected_trees_mixed"] + 0.2
  assert flat["selected_trees_mixed"] == pytest.approx(flat["uniform_trees_mixed"], abs=0.15)
  for kappa in ps.POSTERIOR_KAPPAS:
    assert own[f"selected_trees_mixed_posterior{kappa:g}"] > flat["selected_trees_mixed"]


def test_binned_mixed_table_reads_mixedness_off_outcomes():
  # p̂ says nothing about 0.5 here: prompts with p̂ near 0.5 never mix, those with p̂ near 0.9 do.
  rng = np.random.default_rng(2)
  n = 12
  p_fit = np.r_[rng.uniform(0.45, 0.55, 100), rng.uniform(0.85, 0.95, 100)]
  k_fit = np.r_[rng.choice([0, n], 100), rng.binomial(n, 0.5, 100)]
  table = ps.binned_mixed_table(p_fit, k_fit, n, np.array([0.5, 0.9]), (2, 6), bins=2)
  assert table[0].tolist() == [0.0, 0.0]
  assert table[1] == pytest.approx([1 - 2 * 0.5 ** 2, 1 - 2 * 0.5 ** 6], abs=0.05)
  with pytest.raises(ValueError, match="at least that many samples"):
    ps.binned_mixed_table(p_fit, k_fit, n, np.array([0.5]), (2, 13))
