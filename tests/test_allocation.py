"""Tests for the TRACE allocators (exactness vs brute force, bounds) and baseline strategies."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from trace_jax.allocation import allocators as alloc
from trace_jax.allocation import strategies as strat
from trace_jax.allocation.strategies import base as strat_base
from trace_jax.allocation.strategies.tree_grpo import tree_grpo_counts

_SETTINGS = settings(deadline=None, max_examples=40, derandomize=True)
_probs = st.floats(0.0, 1.0, allow_nan=False, width=32)


def _brute_roots(p, budget, min_per_prompt, cap):
  p = np.asarray(p, np.float64)
  best = -np.inf
  for ms in itertools.product(range(min_per_prompt, cap + 1), repeat=len(p)):
    if sum(ms) == budget:
      best = max(best, sum(1 - pi**m - (1 - pi) ** m for pi, m in zip(p, ms)))
  return best


def _roots_value(p, m):
  p, m = np.asarray(p, np.float64), np.asarray(m)
  return float(np.sum(np.where(m > 0, 1 - p**m - (1 - p) ** m, 0.0)))


def test_root_value_basics():
  np.testing.assert_allclose(alloc.root_value(0.5, 2), 0.5)
  np.testing.assert_allclose(alloc.root_value(jnp.array([0.3, 0.0, 1.0]), 1), [0.0, 0.0, 0.0])
  assert float(alloc.root_value(0.3, 0)) == 0.0
  np.testing.assert_allclose(alloc.root_value(0.2, 3), 1 - 0.2**3 - 0.8**3, rtol=1e-6)


@_SETTINGS
@given(p=st.lists(_probs, min_size=3, max_size=3), budget=st.integers(3, 9),
       min_per_prompt=st.integers(1, 2), cap=st.sampled_from([None, 4]))
def test_allocate_roots_matches_brute_force(p, budget, min_per_prompt, cap):
  if budget < 3 * min_per_prompt or (cap is not None and budget > 3 * cap):
    return
  m = np.asarray(alloc.allocate_roots(jnp.array(p), budget, min_per_prompt, cap))
  assert m.sum() == budget and m.min() >= min_per_prompt
  if cap is not None:
    assert m.max() <= cap
  best = _brute_roots(p, budget, min_per_prompt, budget if cap is None else cap)
  np.testing.assert_allclose(_roots_value(p, m), best, atol=1e-5)


def test_allocate_roots_prefers_uncertain_prompts_and_jits():
  p = jnp.array([0.5, 0.02, 0.98, 0.4])
  f = jax.jit(functools.partial(alloc.allocate_roots, budget=16, min_per_prompt=2))
  m = np.asarray(f(p))
  assert m.sum() == 16 and m.min() >= 2
  assert m[0] > m[1] and m[0] > m[2] and m[3] > m[1]


def test_allocate_roots_equal_predictions_round_robin():
  m = np.asarray(alloc.allocate_roots(jnp.full((4,), 0.5), 10, 1))
  np.testing.assert_array_equal(m, [3, 3, 2, 2])


def test_allocate_roots_errors():
  with pytest.raises(ValueError, match="budget 5 < num_prompts 3"):
    alloc.allocate_roots(jnp.full((3,), 0.5), 5, 2)
  with pytest.raises(ValueError, match="min_per_prompt must be >= 1"):
    alloc.allocate_roots(jnp.full((3,), 0.5), 5, 0)
  with pytest.raises(ValueError, match="max_per_prompt"):
    alloc.allocate_roots(jnp.full((3,), 0.5), 10, 1, 3)


def _brute_subset(p, budget, n_sel, lo, hi):
  best = -np.inf
  for ms in itertools.product([0, *range(lo, hi + 1)], repeat=len(p)):
    if sum(ms) == budget and sum(m > 0 for m in ms) == n_sel:
      best = max(best, _roots_value(p, np.asarray(ms)))
  return best


@_SETTINGS
@given(p=st.lists(_probs, min_size=5, max_size=5), n_sel=st.integers(1, 4),
       lo=st.integers(1, 2), extra=st.integers(0, 3), budget=st.integers(1, 12))
def test_allocate_roots_subset_matches_brute_force(p, n_sel, lo, extra, budget):
  hi = lo + extra
  if not n_sel * lo <= budget <= n_sel * hi:
    return
  m = np.asarray(alloc.allocate_roots_subset(jnp.array(p), budget, n_sel, lo, hi))
  assert m.sum() == budget and (m > 0).sum() == n_sel
  assert all(x == 0 or lo <= x <= hi for x in m), m
  # A lone rollout scores 0 but is a legal choice, so compare values, not counts.
  np.testing.assert_allclose(_roots_value(p, m), _brute_subset(p, budget, n_sel, lo, hi),
                             atol=1e-5)


def test_allocate_roots_subset_picks_uncertain_prompts_and_jits():
  p = jnp.array([0.01, 0.5, 0.3, 0.99, 0.7, 0.05, 0.0, 1.0])
  f = jax.jit(functools.partial(alloc.allocate_roots_subset, budget=12, num_selected=3,
                                min_per_prompt=2, max_per_prompt=6))
  np.testing.assert_array_equal(np.asarray(f(p)), [0, 4, 4, 0, 4, 0, 0, 0])
  # With the whole pool selected it agrees with the greedy allocator.
  q = jnp.array([0.2, 0.5, 0.9])
  np.testing.assert_allclose(
      _roots_value(q, np.asarray(alloc.allocate_roots_subset(q, 9, 3, 1, 5))),
      _roots_value(q, np.asarray(alloc.allocate_roots(q, 9, 1, 5))), atol=1e-6)


def test_allocate_roots_subset_errors():
  with pytest.raises(ValueError, match="num_selected"):
    alloc.allocate_roots_subset(jnp.full((3,), 0.5), 6, 4, 1)
  with pytest.raises(ValueError, match="no allocation"):
    alloc.allocate_roots_subset(jnp.full((6,), 0.5), 5, 3, 2, 4)
  with pytest.raises(ValueError, match="no allocation"):
    alloc.allocate_roots_subset(jnp.full((6,), 0.5), 13, 3, 2, 4)
  with pytest.raises(ValueError, match="min_per_prompt"):
    alloc.allocate_roots_subset(jnp.full((6,), 0.5), 6, 3, 0, 4)


_prefixes = jax.jit(alloc.allocate_prefixes,
                    static_argnames=("max_per_anchor", "budget_unit", "cost_aware"))
_tree_aware = jax.jit(alloc.allocate_prefixes_tree_aware,
                      static_argnames=("max_per_anchor", "budget_unit", "cost_aware"))
_CAP = 3


def _all_counts(h):
  return itertools.product(range(_CAP + 1), repeat=h)


def _brute(value_fn, spend, budget, valid):
  best = -np.inf
  for k in _all_counts(len(spend)):
    k = np.asarray(k)
    if np.any(k[~valid] > 0) or np.dot(k, spend) > budget + 1e-6:
      continue
    best = max(best, value_fn(k))
  return best


def _sum_value(p, r, k, valid):
  q = r * p + (1 - r) * (1 - p)
  return float(np.sum(np.where(valid, 1 - q**k, 0.0)))


def _tree_value(p, r, k, tree, mixed, valid, lam):
  q = r * p + (1 - r) * (1 - p)
  total = 0.0
  for t in range(len(mixed)):
    sel = (tree == t) & valid
    if mixed[t]:
      total += lam * np.sum(1 - q[sel] ** k[sel])
    else:
      total += 1 - np.prod(q[sel] ** k[sel])
  return total


_anchor = st.tuples(_probs, st.sampled_from([0.0, 1.0]), st.floats(1.0, 5.0, width=32),
                    st.booleans())


def _unpack(anchors):
  p, r, c, v = (np.asarray(x) for x in zip(*anchors))
  return p.astype(np.float64), r.astype(np.float64), c.astype(np.float64), v.astype(bool)


@_SETTINGS
@given(anchors=st.lists(_anchor, min_size=4, max_size=4), budget=st.integers(0, 8))
def test_prefixes_rollout_budget_exact(anchors, budget):
  p, r, c, v = _unpack(anchors)
  k = np.asarray(_prefixes(p, r, c, budget, v, max_per_anchor=_CAP, cost_aware=False))
  assert k.sum() == min(budget, _CAP * v.sum()) and np.all(k[~v] == 0) and k.max() <= _CAP
  best = _brute(lambda kk: _sum_value(p, r, kk, v), np.ones(4), budget, v)
  np.testing.assert_allclose(_sum_value(p, r, k, v), best, atol=1e-5)
  np.testing.assert_allclose(alloc.prefix_objective(p, r, k, v), _sum_value(p, r, k, v), atol=1e-5)


@_SETTINGS
@given(anchors=st.lists(_anchor, min_size=4, max_size=4), budget=st.floats(0.0, 14.0, width=32))
def test_prefixes_token_budget_within_knapsack_bound(anchors, budget):
  p, r, c, v = _unpack(anchors)
  k = np.asarray(_prefixes(p, r, c, budget, v, max_per_anchor=_CAP, budget_unit="tokens"))
  assert np.dot(k, c) <= budget + 1e-4 and np.all(k[~v] == 0)
  q = r * p + (1 - r) * (1 - p)
  max_gain = float(np.max(np.where(v, 1 - q, 0.0), initial=0.0))
  best = _brute(lambda kk: _sum_value(p, r, kk, v), c, budget, v)
  assert _sum_value(p, r, k, v) >= best - max_gain - 1e-5


@_SETTINGS
@given(anchors=st.lists(_anchor, min_size=4, max_size=4),
       tree=st.lists(st.integers(0, 1), min_size=4, max_size=4),
       mixed=st.lists(st.booleans(), min_size=2, max_size=2), budget=st.integers(0, 7))
def test_tree_aware_rollout_budget_exact(anchors, tree, mixed, budget):
  p, r, c, v = _unpack(anchors)
  tree, mixed = np.asarray(tree), np.asarray(mixed)
  k = np.asarray(_tree_aware(p, r, c, tree, mixed, budget, v, max_per_anchor=_CAP, lam=0.1,
                             cost_aware=False))
  assert k.sum() == min(budget, _CAP * v.sum())
  value = lambda kk: _tree_value(p, r, kk, tree, mixed, v, 0.1)
  np.testing.assert_allclose(value(k), _brute(value, np.ones(4), budget, v), atol=1e-5)
  got = float(alloc.tree_aware_objective(p, r, k, tree, mixed, v, 0.1))
  np.testing.assert_allclose(got, value(k), atol=1e-5)


@_SETTINGS
@given(anchors=st.lists(_anchor, min_size=4, max_size=4),
       mixed=st.lists(st.booleans(), min_size=4, max_size=4), budget=st.floats(0.0, 14.0, width=32))
def test_tree_aware_single_anchor_trees_token_bound(anchors, mixed, budget):
  p, r, c, v = _unpack(anchors)
  tree, mixed = np.arange(4), np.asarray(mixed)
  k = np.asarray(_tree_aware(p, r, c, tree, mixed, budget, v, max_per_anchor=_CAP, lam=0.1,
                             budget_unit="tokens"))
  assert np.dot(k, c) <= budget + 1e-4
  q = r * p + (1 - r) * (1 - p)
  first_gain = np.where(mixed, 0.1, 1.0) * (1 - q)
  max_gain = float(np.max(np.where(v, first_gain, 0.0), initial=0.0))
  value = lambda kk: _tree_value(p, r, kk, tree, mixed, v, 0.1)
  assert value(k) >= _brute(value, c, budget, v) - max_gain - 1e-5


def test_tree_aware_prefers_unmixed_trees_and_stops_spending_on_mixed():
  # Same anchors in both trees; tree 0 is already mixed, tree 1 is not.
  p = jnp.array([0.5, 0.5, 0.5, 0.5])
  r = jnp.array([1.0, 1.0, 1.0, 1.0])
  tree = jnp.array([0, 0, 1, 1])
  mixed = jnp.array([True, False])
  valid = jnp.ones(4, bool)
  k = np.asarray(_tree_aware(p, r, jnp.ones(4), tree, mixed, 2, valid, max_per_anchor=4))
  np.testing.assert_array_equal(k[:2], [0, 0])
  assert k[2:].sum() == 2
  # The summed objective cannot tell the trees apart and spreads over all four anchors.
  k_sum = np.asarray(_prefixes(p, r, jnp.ones(4), 4, valid, max_per_anchor=4))
  np.testing.assert_array_equal(k_sum, [1, 1, 1, 1])


def test_prefixes_cost_aware_prefers_cheap_anchor():
  p = jnp.array([0.5, 0.5])
  r = jnp.array([1.0, 0.0])
  k = np.asarray(_prefixes(p, r, jnp.array([10.0, 1.0]), 1, jnp.ones(2, bool), max_per_anchor=2))
  np.testing.assert_array_equal(k, [0, 1])


def test_prefixes_token_budget_and_caps():
  p = jnp.array([0.9, 0.5, 0.1])
  r = jnp.array([1.0, 1.0, 1.0])
  costs = jnp.array([2.0, 3.0, 4.0])
  valid = jnp.array([True, True, False])
  k = np.asarray(_prefixes(p, r, costs, 100.0, valid, max_per_anchor=2, budget_unit="tokens"))
  np.testing.assert_array_equal(k, [2, 2, 0])  # Caps bind before the budget.
  k = np.asarray(_prefixes(p, r, costs, 4.0, valid, max_per_anchor=2, budget_unit="tokens"))
  assert np.dot(k, costs) <= 4.0 and k.sum() >= 1
  with pytest.raises(ValueError, match="budget_unit"):
    alloc.allocate_prefixes(p, r, costs, 1, valid, 2, budget_unit="steps")


def test_prefixes_vmap_over_batches():
  p = jnp.array([[0.5, 0.9], [0.9, 0.5]])
  r = jnp.ones((2, 2))
  f = jax.vmap(lambda pp, rr: alloc.allocate_prefixes(pp, rr, jnp.ones(2), 1, jnp.ones(2, bool), 2))
  np.testing.assert_array_equal(np.asarray(f(p, r)), [[1, 0], [0, 1]])


def test_blend_with_outcomes():
  out = alloc.blend_with_outcomes(jnp.array([0.5, 0.5, 0.2]), jnp.array([0.0, 3.0, 1.0]),
                                  jnp.array([0.0, 4.0, 1.0]), 2.0)
  np.testing.assert_allclose(out, [0.5, 4.0 / 6.0, 1.4 / 3.0], rtol=1e-6)
  np.testing.assert_allclose(alloc.blend_with_outcomes(0.3, 0.0, 0.0, 0.0), 0.3)


# Strategies: the registry and the rules the baselines run with.


def test_strategy_registry():
  assert strat.names() == ("trace", "trace_tree", "root_only", "grpo", "dapo", "tree_grpo", "arpo")
  for name in strat.names():
    assert name in strat.__doc__ and strat.get(name).name == name
  with pytest.raises(ValueError, match="unknown strategy"):
    strat.get("ppo")
  assert [m for m in strat.names() if not strat.get(m).has_stage2()] == ["grpo", "dapo"]
  assert strat.advantage_for("tree_grpo", "tree_contrastive") == "tree_grpo"
  assert strat.advantage_for("trace_tree", "treerl") == "treerl"


def test_uniform_roots():
  np.testing.assert_array_equal(strat_base.uniform_roots(4, 10), [3, 3, 2, 2])
  np.testing.assert_array_equal(strat_base.uniform_roots(3, 6), [2, 2, 2])


def test_tree_grpo_counts_spread_over_trees_distinct_anchors_and_uniform():
  """Each tree gets its share; within a tree distinct anchors first, each equally likely."""
  cands = [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2)]
  k = tree_grpo_counts(np.random.default_rng(0), cands, 4, cap=4)
  assert k.sum() == 4 and k[:3].sum() == 2 and k[3:].sum() == 2 and k.max() == 1
  k = tree_grpo_counts(np.random.default_rng(1), cands, 9, cap=2)  # caps bind: shares pass on
  assert k.sum() == 9 and k.max() <= 2
  hits = sum(tree_grpo_counts(np.random.default_rng(s), cands[:3], 1, cap=1) for s in range(600))
  assert hits.min() > 150  # each of 3 anchors ~200 times


def test_round_robin_caps_and_joins_the_next():
  k = strat_base.round_robin([3, 1, 0, 2], 4, budget=5, cap=2, first=2)
  np.testing.assert_array_equal(k, [1, 2, 0, 2])  # 3 and 1 full at 2 each, then 0 joins
  np.testing.assert_array_equal(strat_base.round_robin([0, 1], 2, budget=9, cap=2), [2, 2])


def test_uniform_prefixes():
  valid = jnp.array([False, True, True, False, True])
  np.testing.assert_array_equal(strat_base.uniform_prefixes(valid, 7), [0, 3, 2, 0, 2])
  np.testing.assert_array_equal(strat_base.uniform_prefixes(jnp.zeros(3, bool), 5), [0, 0, 0])
  k = np.asarray(jax.jit(strat_base.uniform_prefixes)(valid, 4, jax.random.key(3)))
  assert k.sum() == 4 and sorted(k[[1, 2, 4]]) == [1, 1, 2] and k[0] == k[3] == 0


def test_anchor_posterior():
  """Beta posterior of the tree's counts around p̂(root), shifted in logit by p̂(h) - p̂(root)."""
  logit = lambda p: np.log(p) - np.log1p(-p)  # noqa: E731
  sig = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
  p_anchor = jnp.array([0.5, 0.8, 0.3, 0.6])
  p_root = jnp.array([0.5, 0.5, 0.3, 0.6])
  succ = jnp.array([0.0, 0.0, 3.0, 0.0])
  trials = jnp.array([4.0, 4.0, 3.0, 0.0])
  out = np.asarray(alloc.anchor_posterior(p_anchor, p_root, succ, trials, 4.0))
  tree0 = (4 * 0.5 + 0) / 8  # 0.25
  tree2 = (4 * 0.3 + 3) / 7
  np.testing.assert_allclose(out, [tree0, sig(logit(tree0) + logit(0.8) - logit(0.5)), tree2, 0.6],
                             rtol=1e-5)
  # s = 0: the counts alone; an anchor equal to its root gets the tree's rate (clipped).
  out0 = np.asarray(alloc.anchor_posterior(p_root, p_root, succ, trials, 0.0))
  np.testing.assert_allclose(out0, [1e-4, 1e-4, 1 - 1e-4, 0.6], rtol=1e-5)


def test_platt_fit_recovers_a_known_map_and_shrinks_to_identity():
  from trace_jax.allocation.allocators import platt_apply, platt_fit
  rng = np.random.default_rng(0)
  logit = rng.normal(0, 2, 4000)
  p_hat = 1 / (1 + np.exp(-logit))
  y = (rng.random(4000) < 1 / (1 + np.exp(-(0.5 * logit - 0.4)))).astype(np.float64)
  a, b = platt_fit(p_hat, y, prior_strength=1.0)
  assert abs(a - 0.5) < 0.06 and abs(b + 0.4) < 0.1
  assert platt_fit(p_hat[:4], y[:4], prior_strength=1e6) == pytest.approx((1.0, 0.0), abs=1e-3)
  assert platt_apply(np.array([0.5]), 1.0, 0.0)[0] == pytest.approx(0.5)
  with pytest.raises(ValueError, match="equal 1-D"):
    platt_fit(p_hat, y[:3])


def test_platt_fit_is_stable_on_saturated_predictions():
  # p̂ pushed to the clip (logits near +-9) that still ranks outcomes better than chance: the slope
  # must stay positive (a plain Newton step from the identity overshoots to a negative slope).
  from trace_jax.allocation.allocators import platt_fit
  rng = np.random.default_rng(1)
  for _ in range(20):
    n = 80
    p_hat = np.where(rng.random(n) < 0.5, 1e-4, 1 - 1e-4) * 1.0
    mid = rng.random(n) < 0.3
    p_hat[mid] = rng.uniform(0.2, 0.8, mid.sum())
    y = (rng.random(n) < np.where(p_hat > 0.5, 0.6, 0.25)).astype(np.float64)
    a, b = platt_fit(p_hat, y, prior_strength=10.0)
    assert 0.0 < a < 1.0, (a, b)


def test_eager_calls_compile_once_per_shape():
  # The allocators' loops used to close over per-call values, so every eager call retraced and
  # recompiled (0.6 s and a growing cache per stage-1 call on a 48-prompt pool). Now they run
  # module-level jitted programs: new values with the same shapes and static bounds reuse them.
  from trace_jax.allocation import allocators as A

  rng = np.random.default_rng(0)
  programs = (A._subset_program, A._greedy_roots, A._greedy_program)

  def call_all():
    p = jnp.asarray(rng.uniform(size=12), jnp.float32)
    o = jnp.asarray(rng.integers(0, 2, 12), jnp.float32)
    A.allocate_roots_subset(p, 24, 4, 2, 8)
    A.allocate_roots(p, 40, 2, 6)
    A.allocate_prefixes(p, o, jnp.ones(12), 6, jnp.ones(12, bool), 3)
    A.allocate_prefixes_tree_aware(p, o, jnp.ones(12), jnp.arange(12) % 3,
                                   jnp.array([False, True, False]), 6, jnp.ones(12, bool), 3)

  call_all()
  sizes = [f._cache_size() for f in programs]
  for _ in range(3):
    call_all()
  assert [f._cache_size() for f in programs] == sizes


def test_binned_root_beta_recovers_each_bins_spread():
  # Two kinds of prompts the head cannot tell apart within a kind: at p̂ 0.3 the true rates are
  # Beta(κ=1) about 0.6, at p̂ 0.8 they are Beta(κ=6) about 0.2 (a head both shifted and flat).
  rng = np.random.default_rng(0)
  n = 4000
  p_log = np.r_[np.full(n, 0.3), np.full(n, 0.8)]
  rate = np.r_[rng.beta(0.6, 0.4, n), rng.beta(1.2, 4.8, n)]
  m_log = rng.integers(2, 9, 2 * n)
  k_log = rng.binomial(m_log, rate)
  mu, kappa = alloc.binned_root_beta(p_log, k_log, m_log, np.array([0.3, 0.8, 0.31]), bins=2)
  assert mu[:2] == pytest.approx([0.6, 0.2], abs=0.02)
  assert kappa[0] == pytest.approx(1.0, rel=0.15) and kappa[1] == pytest.approx(6.0, rel=0.25)
  assert (mu[2], kappa[2]) == (mu[0], kappa[0])  # a query takes its bin's Beta
  # Binomial noise alone (every prompt at its p̂) gives the top of the κ range, or near it.
  k_flat = rng.binomial(m_log, p_log)
  _, kappa_flat = alloc.binned_root_beta(p_log, k_flat, m_log, np.array([0.3, 0.8]), bins=2)
  assert np.all(kappa_flat > 100)
  # The table it feeds values a spread-out bin's rollouts less than a tight one's.
  table = alloc.root_value_table(mu[:2], (4,), "binned", kappa[:2])
  assert float(table[0, 0]) < float(table[1, 0])
  with pytest.raises(ValueError, match="0 <= k <= m"):
    alloc.binned_root_beta([0.5], [3], [2], [0.5])
  with pytest.raises(ValueError, match="at least one"):
    alloc.binned_root_beta([], [], [], [0.5])
