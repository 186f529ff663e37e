"""TRACE: stage 1 on p̂ over the pool, stage 2 on the predicted chance of contrast at each anchor.

  trace        the paper's prefix objective: Σ_h 1 - q_h^k over anchors (`allocate_prefixes`)
  trace_tree   the tree-aware objective: the chance each unmixed tree becomes mixed, λ for extra
               contrast in trees already mixed (`allocate_prefixes_tree_aware`)

Both rank by marginal gain per expected token when the budget is in tokens (`cost_aware`), and
count the root of an unmixed tree as an anchor. They train with the run's configured advantage
(tree contrastive by default).
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from trace_jax.allocation import allocators
from trace_jax.allocation.strategies.base import prefix_budget, register
from trace_jax.allocation.strategies.predicted import PredictedRoots, anchor_estimates, pad_to

_ANCHOR_BUCKET, _TREE_BUCKET = 64, 16  # candidates and trees padded to these multiples


class _PredictedPrefixes(PredictedRoots):
  root_anchors = True

  def prefix_counts(self, driver, trees, cands, use_predictor):
    c, h = self.cfg, len(cands)
    if h == 0 or c.prefix_budget <= 0:
      return np.zeros(h, np.int32), None
    budget = prefix_budget(c, trees, cands)
    p_hat, outcomes = anchor_estimates(driver, trees, cands, use_predictor)
    spend = budget.token_budget if budget.tokens else c.prefix_budget
    cost_aware = bool(c.cost_aware and budget.tokens)
    hp = -(-h // _ANCHOR_BUCKET) * _ANCHOR_BUCKET
    args = (pad_to(p_hat, hp, 0.5), pad_to(outcomes, hp, 0.0), pad_to(budget.costs, hp, 1.0))
    valid = pad_to(np.ones(h, bool), hp, False)
    k = self._allocate(trees, cands, args, spend, valid, hp, cost_aware)
    return np.asarray(k)[:h], p_hat


  def value_curve(self, driver, trees, cands, use_predictor, max_units):
    """The objective of the greedy allocation at every budget 0..max_units (rollouts), all
    budgets in one vmapped call: the greedy's b-th pick is its best b-th unit, so the increments
    are its marginal gains. None under a token budget (its units are not rollouts)."""
    c, h = self.cfg, len(cands)
    if c.budget_unit != "rollouts":
      return None
    if h == 0:
      return np.zeros(int(max_units) + 1, np.float32)
    p_hat, outcomes = anchor_estimates(driver, trees, cands, use_predictor)
    hp = -(-h // _ANCHOR_BUCKET) * _ANCHOR_BUCKET
    tree_ids = pad_to(np.asarray([ti for ti, _ in cands], np.int32), hp, 0)
    mixed = np.zeros(-(-len(trees) // _TREE_BUCKET) * _TREE_BUCKET, bool)
    mixed[:len(trees)] = [t.mixed for t in trees]
    fn = _curve(self.name, c.max_per_anchor, c.tree_lambda, int(max_units))
    return np.asarray(fn(pad_to(p_hat, hp, 0.5), pad_to(outcomes, hp, 0.0), tree_ids, mixed,
                         pad_to(np.ones(h, bool), hp, False)), np.float32)


@register
class Trace(_PredictedPrefixes):
  name = "trace"

  def _allocate(self, trees, cands, args, spend, valid, hp, cost_aware):
    c = self.cfg
    return _alloc_prefixes(c.max_per_anchor, c.budget_unit, cost_aware)(*args, spend, valid)



@register
class TraceTree(_PredictedPrefixes):
  name = "trace_tree"

  def _allocate(self, trees, cands, args, spend, valid, hp, cost_aware):
    c = self.cfg
    tree_ids = pad_to(np.asarray([ti for ti, _ in cands], np.int32), hp, 0)
    mixed = np.zeros(-(-len(trees) // _TREE_BUCKET) * _TREE_BUCKET, bool)
    mixed[:len(trees)] = [t.mixed for t in trees]
    return _alloc_tree_aware(c.max_per_anchor, c.budget_unit, c.tree_lambda, cost_aware)(
        *args, tree_ids, mixed, spend, valid)


@functools.lru_cache(maxsize=None)
def _alloc_prefixes(max_per_anchor, budget_unit, cost_aware):
  return jax.jit(lambda p, o, c, b, v: allocators.allocate_prefixes(
      p, o, c, b, v, max_per_anchor, budget_unit=budget_unit, cost_aware=cost_aware))


@functools.lru_cache(maxsize=None)
def _alloc_tree_aware(max_per_anchor, budget_unit, lam, cost_aware):
  return jax.jit(lambda p, o, c, t, m, b, v: allocators.allocate_prefixes_tree_aware(
      p, o, c, t, m, b, v, max_per_anchor, lam, budget_unit=budget_unit, cost_aware=cost_aware))


@functools.lru_cache(maxsize=None)
def _curve(name, max_per_anchor, lam, max_units):
  """Jitted objective of the greedy allocation at budgets 0..max_units (rollouts), f32[B + 1]."""
  import jax.numpy as jnp

  def one(p, o, t, m, valid, b):
    cost = jnp.ones_like(p)
    if name == "trace":
      k = allocators.allocate_prefixes(p, o, cost, b, valid, max_per_anchor)
      return allocators.prefix_objective(p, o, k, valid)
    k = allocators.allocate_prefixes_tree_aware(p, o, cost, t, m, b, valid, max_per_anchor, lam)
    return allocators.tree_aware_objective(p, o, k, t, m, valid, lam)

  budgets = jnp.arange(max_units + 1)
  return jax.jit(lambda p, o, t, m, v: jax.vmap(lambda b: one(p, o, t, m, v, b))(budgets))
