"""Stage 1's root objectives: the Beta posterior of V_root, the information gain of m rollouts,
their reduction to the paper's V_root as the head's uncertainty vanishes, and the allocators fed
any value table."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from trace_jax.allocation import allocators as alloc

_SETTINGS = settings(deadline=None, max_examples=30, derandomize=True)


@pytest.mark.parametrize("p,kappa,m", [(0.9, 4.0, 4), (0.1, 8.0, 6), (0.5, 2.0, 3),
                                       (0.3, 30.0, 12), (0.05, 3.0, 8)])
def test_posterior_value_and_information_gain_match_quadrature(p, kappa, m):
  from scipy import integrate, stats

  a, b = kappa * p, kappa * (1 - p)
  dens = stats.beta(a, b).pdf

  def quad(f):
    return integrate.quad(lambda x: dens(x) * f(x), 0, 1, limit=200, points=[1e-6, 1 - 1e-6])[0]

  want_v = quad(lambda x: 1 - x**m - (1 - x)**m)
  got_v = float(alloc.root_value_posterior(a, b, m, max_m=12))
  assert abs(got_v - want_v) < 1e-4
  # I(p; k) = H(k) - E_p[H(k | p)]: k's beta-binomial entropy, the binomial's by quadrature.
  pk = stats.betabinom(m, a, b).pmf(np.arange(m + 1))
  h_k = -np.sum(pk * np.log(pk))
  h_cond = quad(lambda x: stats.binom(m, x).entropy())
  got_i = float(alloc.information_gain(a, b, m, max_m=12))
  assert abs(got_i - (h_k - h_cond)) < 1e-3


@_SETTINGS
@given(p=st.floats(0.01, 0.99), m=st.integers(0, 12))
def test_objectives_reduce_to_the_paper_as_uncertainty_vanishes(p, m):
  paper = float(alloc.root_value(p, m))
  for objective in ("posterior", "discovery"):
    v = alloc.root_value_table(jnp.array([p]), [m], objective, concentration=1e4, beta=1.0)
    assert abs(float(v[0, 0]) - paper) < 2e-3, (objective, p, m)
  # And the gap shrinks monotonically as κ grows (Jensen: never above the paper's value).
  gaps = [paper - float(alloc.root_value_table(jnp.array([p]), [m], "posterior", k)[0, 0])
          for k in (2.0, 8.0, 64.0, 1e4)]
  assert all(g >= -1e-5 for g in gaps)
  assert all(x >= y - 1e-5 for x, y in zip(gaps, gaps[1:]))


def test_information_gain_properties():
  a, b = alloc.beta_params(0.5, 2.0)
  gains = np.asarray([float(alloc.information_gain(a, b, m, 12)) for m in range(13)])
  assert gains[0] == 0.0
  steps = np.diff(gains)
  assert (steps > 0).all() and (np.diff(steps) <= 1e-6).all()  # increasing, diminishing returns
  # More certain heads leave less to learn.
  by_kappa = [float(alloc.information_gain(*alloc.beta_params(0.1, k), 6, 6))
              for k in (2.0, 10.0, 100.0)]
  assert by_kappa[0] > by_kappa[1] > by_kappa[2] > 0


def test_discovery_spends_on_an_uncertain_hard_prompt():
  # Two prompts of the same point estimate p̂ = 0.05; the head is sure of one (κ = 1000) and not of
  # the other (κ = 2). The paper cannot tell them apart; discovery gives the unknown one more.
  p = jnp.array([0.05, 0.05, 0.5])
  counts = list(range(0, 9))
  kappa = jnp.array([1000.0, 2.0, 1000.0])
  paper = alloc.root_value_table(p, counts, "paper")
  disc = alloc.root_value_table(p, counts, "discovery", kappa, beta=1.0)
  m_paper = np.asarray(alloc.allocate_roots(p, 12, 2, 8, values=paper))
  m_disc = np.asarray(alloc.allocate_roots(p, 12, 2, 8, values=disc))
  assert abs(int(m_paper[0]) - int(m_paper[1])) <= 1  # equal values, ties to the lower index
  assert m_disc[1] > m_disc[0] and m_disc[1] > m_paper[1]
  # The greedy allocator with the paper's table is the allocator without one.
  np.testing.assert_array_equal(m_paper, np.asarray(alloc.allocate_roots(p, 12, 2, 8)))


def _brute(values, budget, n_sel, lo, hi):
  best = -np.inf
  for ms in itertools.product([0, *range(lo, hi + 1)], repeat=values.shape[0]):
    if sum(ms) == budget and sum(m > 0 for m in ms) == n_sel:
      best = max(best, sum(values[i, m - lo] for i, m in enumerate(ms) if m > 0))
  return best


@_SETTINGS
@given(seed=st.integers(0, 10**6), objective=st.sampled_from(alloc.ROOT_OBJECTIVES))
def test_subset_dp_is_exact_for_every_objective_table(seed, objective):
  rng = np.random.default_rng(seed)
  p = jnp.asarray(rng.uniform(0.01, 0.99, 5), jnp.float32)
  kappa = jnp.asarray(rng.uniform(1.0, 50.0, 5), jnp.float32)
  lo, hi, n_sel, budget = 2, 4, 3, int(rng.integers(6, 13))
  table = np.asarray(alloc.root_value_table(p, list(range(lo, hi + 1)), objective, kappa, 0.7))
  m = np.asarray(jax.jit(lambda q, v: alloc.allocate_roots_subset(q, budget, n_sel, lo, hi, v))(
      p, table))
  assert m.sum() == budget and (m > 0).sum() == n_sel
  got = sum(table[i, x - lo] for i, x in enumerate(m) if x > 0)
  np.testing.assert_allclose(got, _brute(table, budget, n_sel, lo, hi), atol=1e-5)


def test_value_table_errors():
  with pytest.raises(ValueError, match="root objective"):
    alloc.root_value_table(jnp.array([0.5]), [2], "ucb")
  with pytest.raises(ValueError, match="values must be"):
    alloc.allocate_roots_subset(jnp.full((3,), 0.5), 6, 3, 2, 2, values=jnp.zeros((3, 4)))
  with pytest.raises(ValueError, match="values must be"):
    alloc.allocate_roots(jnp.full((3,), 0.5), 6, 2, 2, values=jnp.zeros((3, 2)))


def test_concentration_from_spread():
  # A Beta(2, 6) has mean 0.25 and variance 0.25 * 0.75 / 9.
  kappa = float(alloc.concentration_from_spread(0.25, 0.25 * 0.75 / 9))
  assert abs(kappa - 8.0) < 1e-3
  assert float(alloc.concentration_from_spread(0.5, 0.0)) == 1e4  # no spread: the cap
  assert float(alloc.concentration_from_spread(0.5, 0.3)) == 2.0  # wider than a Beta: the floor
