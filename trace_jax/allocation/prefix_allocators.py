"""TRACE stage 2: how many continuations each candidate anchor (a turn-boundary prefix) gets.

Stage 2 values k continuations from an anchor h, whose rollout ended with outcome r, by
V_pref(h, k) = 1 - q_h^k, where q_h = r p_h + (1 - r)(1 - p_h) is the chance that one continuation
repeats r (`repeat_prob`). `allocate_prefixes` maximizes the sum over anchors
(`prefix_objective`), `allocate_prefixes_tree_aware` the chance that each unmixed tree becomes mixed
(`tree_aware_objective`). Both are pure and jittable and return i32 counts; the greedy loops run one
pick per iteration, O(num_candidates) work each; budgets are hundreds to a few thousand picks,
which is cheap next to sampling a single token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Keeps log(q) finite where q == 0 (a continuation surely differs from r); exp(k * log) -> 0 anyway.
_TINY = 1e-30


def repeat_prob(p_hat, outcomes):
  """q_h = r p + (1 - r)(1 - p): chance one continuation from h repeats the outcome r. f32[H]."""
  p = jnp.clip(jnp.asarray(p_hat, jnp.float32), 0.0, 1.0)
  r = jnp.clip(jnp.asarray(outcomes, jnp.float32), 0.0, 1.0)
  return r * p + (1.0 - r) * (1.0 - p)


def prefix_objective(p_hat, outcomes, counts, valid):
  """Summed stage-2 objective sum_h valid_h (1 - q_h^{k_h}). Returns f32[]."""
  q = repeat_prob(p_hat, outcomes)
  v = 1.0 - q ** jnp.asarray(counts, jnp.float32)
  return jnp.sum(jnp.where(valid, v, 0.0))


def tree_aware_objective(p_hat, outcomes, counts, tree, tree_mixed, valid, lam=0.01):
  """Tree-aware stage-2 objective.

  sum over unmixed trees t of (1 - prod_{h in t} q_h^{k_h})  +  lam * sum over anchors h of mixed
  trees of (1 - q_h^{k_h}).

  Args:
    p_hat, outcomes, counts: [H] per anchor; tree: i32[H] tree index in [0, T); valid: bool[H].
    tree_mixed: bool[T] whether the tree's finished leaves already hold both outcomes.
    lam: weight of extra turn-level contrast in already mixed trees.

  Returns:
    f32[] objective value.
  """
  q = repeat_prob(p_hat, outcomes)
  k = jnp.asarray(counts, jnp.float32)
  tree = jnp.asarray(tree, jnp.int32)
  tree_mixed = jnp.asarray(tree_mixed, bool)
  valid = jnp.asarray(valid, bool)
  num_trees = tree_mixed.shape[0]
  log_prod = _tree_log_prod(q, k, tree, valid, num_trees)
  unmixed = jnp.sum(jnp.where(tree_mixed, 0.0, 1.0 - jnp.exp(log_prod)))
  per_anchor = jnp.where(valid & tree_mixed[jnp.clip(tree, 0, num_trees - 1)], 1.0 - q**k, 0.0)
  return unmixed + lam * jnp.sum(per_anchor)


def _tree_log_prod(q, k, tree, valid, num_trees):
  """log prod_{h in t} q_h^{k_h} per tree. f32[T]."""
  logq = jnp.log(jnp.maximum(q, _TINY))
  contrib = jnp.where(valid & (k > 0), k * logq, 0.0)
  seg = jnp.where(valid, tree, num_trees)  # Padding goes out of range and is dropped.
  return jnp.zeros((num_trees,), jnp.float32).at[seg].add(contrib, mode="drop")


def _summed_gain(k, q, _aux):
  """Marginal gain of V_pref(h, k) = 1 - q_h^k: q_h^k (1 - q_h)."""
  return q ** k.astype(jnp.float32) * (1.0 - q)


def _tree_gain(k, q, aux):
  """Marginal gain of the tree-aware objective (`allocate_prefixes_tree_aware`)."""
  tree, tree_mixed, valid, lam = aux
  num_trees = tree_mixed.shape[0]
  at = jnp.clip(tree, 0, num_trees - 1)
  kf = k.astype(jnp.float32)
  prod = jnp.exp(_tree_log_prod(q, kf, tree, valid, num_trees))
  unmixed_gain = prod[at] * (1.0 - q)
  mixed_gain = lam * q**kf * (1.0 - q)
  return jnp.where(tree_mixed[at], mixed_gain, unmixed_gain)


def _greedy(gain_fn, q, aux, costs, budget, valid, max_per_anchor, budget_unit, cost_aware):
  """Hands out continuations one at a time to the best marginal gain (per cost) that still fits.

  The whole budget is spent while any pick fits, even on near-zero gains, so methods compared at
  equal budget really sample equally much. Stops early only when nothing fits (every anchor at its
  cap, or every remaining cost above what is left of a token budget). `gain_fn(k, q, aux)` is a
  module-level function, so the jitted loop compiles once per shape, also when called eagerly.
  """
  if budget_unit not in ("rollouts", "tokens"):
    raise ValueError(f"budget_unit must be 'rollouts' or 'tokens', got {budget_unit!r}")
  return _greedy_program(gain_fn, q, aux, jnp.asarray(costs, jnp.float32),
                         jnp.asarray(budget, jnp.float32), jnp.asarray(valid, bool),
                         int(max_per_anchor), budget_unit, bool(cost_aware))


@functools.partial(jax.jit, static_argnums=(0, 6, 7, 8))
def _greedy_program(gain_fn, q, aux, costs, budget, valid, cap, budget_unit, cost_aware):
  num = costs.shape[0]
  spend = jnp.ones_like(costs) if budget_unit == "rollouts" else costs

  def cond(state):
    _, _, done = state
    return ~done

  def body(state):
    k, left, _ = state
    gain = gain_fn(k, q, aux)
    score = gain / costs if cost_aware else gain
    fits = valid & (k < cap) & (spend <= left)
    score = jnp.where(fits, score, -jnp.inf)
    i = jnp.argmax(score)
    ok = fits[i]
    k = k.at[i].add(ok.astype(jnp.int32))
    left = left - jnp.where(ok, spend[i], 0.0)
    return k, left, ~ok

  k0 = jnp.zeros((num,), jnp.int32)
  state = (k0, budget, jnp.asarray(cap <= 0))
  k, _, _ = jax.lax.while_loop(cond, body, state)
  return k


def allocate_prefixes(p_hat, outcomes, costs, budget, valid, max_per_anchor: int, *,
                      budget_unit: str = "rollouts", cost_aware: bool = True):
  """Stage 2, summed objective: continuations per candidate anchor.

  Greedy on the marginal gain of V_pref(h, k) = 1 - q_h^k, i.e. q_h^k (1 - q_h), divided by the cost
  of one continuation from h when `cost_aware`. V_pref is concave in k, so:
    - with budget_unit="rollouts" and cost_aware=False the greedy is exact;
    - with budget_unit="tokens" (a knapsack) the greedy value is at least OPT minus the largest
      single marginal gain (the fractional-knapsack bound: its picks up to the first one that does
      not fit are a prefix of an LP optimum);
    - with budget_unit="rollouts" and cost_aware=True each pick costs one rollout but is ranked by
      gain per expected token, trading some expected mixing for fewer generated tokens, as the
      method prescribes; this is not exact for the rollout-count objective.

  Args:
    p_hat: f32[H] predicted success probability of each candidate prefix.
    outcomes: f32[H] outcome r in [0, 1] of the rollout the prefix came from.
    costs: f32[H] expected tokens still to generate from h (> 0).
    budget: number of continuations ("rollouts") or generated tokens ("tokens"); may be traced.
    valid: bool[H] candidate mask.
    max_per_anchor: static int cap on continuations per anchor.
    budget_unit: "rollouts" or "tokens".
    cost_aware: rank by gain per cost (default) or by gain alone.

  Returns:
    i32[H] continuation counts.

  Example:
    >>> p_hat, outcomes = jnp.array([0.1, 0.5, 0.9]), jnp.zeros(3)  # anchors of failed rollouts
    >>> k = allocate_prefixes(p_hat, outcomes, jnp.ones(3), 4, jnp.ones(3, bool), max_per_anchor=3)
    >>> k.tolist()  # a near-sure flip needs one continuation; the coin flip gets the rest
    [0, 3, 1]
  """
  q = repeat_prob(p_hat, outcomes)
  return _greedy(_summed_gain, q, None, costs, budget, valid, max_per_anchor, budget_unit,
                 cost_aware)


def allocate_prefixes_tree_aware(p_hat, outcomes, costs, tree, tree_mixed, budget, valid,
                                 max_per_anchor: int, lam: float = 0.01, *,
                                 budget_unit: str = "rollouts", cost_aware: bool = True):
  """Stage 2, tree-aware objective (see `tree_aware_objective`): continuations per anchor.

  The marginal gain of one more continuation from anchor h is prod_t(k) (1 - q_h) in an unmixed tree
  t (prod_t = current prod_{h' in t} q_{h'}^{k_{h'}}), and lam q_h^{k_h} (1 - q_h) in a mixed one.

  Why greedy is a good heuristic here: per unmixed tree the value 1 - exp(sum_h k_h log q_h) is a
  concave function of a non-negative linear function of k, hence DR-submodular. Within a tree every
  pick multiplies the same prod_t, so with unit costs greedy fills the lowest-q anchors first, which
  is the best way to spend any number n of units on that tree, and the tree's best value is concave
  in n. The problem is then separable concave over trees and greedy is exact for a rollout budget
  ranked without costs (tested against brute force). With per-anchor costs it becomes a knapsack
  over a non-separable function and greedy-by-ratio is a heuristic without a general constant-factor
  bound; for single-anchor trees it reduces to the separable case and keeps the OPT - max gain bound
  of `allocate_prefixes` (tested).

  Args:
    p_hat, outcomes, costs, valid, max_per_anchor, budget, budget_unit, cost_aware: as in
      `allocate_prefixes`.
    tree: i32[H] tree index of each anchor, in [0, T).
    tree_mixed: bool[T] whether each tree's finished leaves already hold both outcomes.
    lam: weight of the per-anchor gain in already mixed trees (default 0.01, the run config's
      too). The tree term is the chance that an unmixed tree becomes mixed; a mixed tree has
      already earned it, so the per-anchor term there is a secondary goal (turn-level contrast
      inside a tree that already has contrast) and must not outrank an unmixed tree's gain,
      which for trees worth forking is rarely below a few hundredths: at 0.01 it orders anchors
      in mixed trees among themselves and takes the budget only when no unmixed tree can use it.

  Returns:
    i32[H] continuation counts.

  Example:
    >>> p_hat, outcomes = jnp.array([0.3, 0.6, 0.5]), jnp.array([0.0, 0.0, 1.0])
    >>> tree, tree_mixed = jnp.array([0, 0, 1]), jnp.array([False, True])  # tree 1 already mixed
    >>> allocate_prefixes_tree_aware(p_hat, outcomes, jnp.ones(3), tree, tree_mixed, 4,
    ...                              jnp.ones(3, bool), max_per_anchor=4).tolist()
    [0, 4, 0]
    >>> allocate_prefixes_tree_aware(p_hat, outcomes, jnp.ones(3), tree, tree_mixed, 4,
    ...                              jnp.ones(3, bool), max_per_anchor=4, lam=0.1).tolist()
    [0, 3, 1]
  """
  q = repeat_prob(p_hat, outcomes)
  tree = jnp.asarray(tree, jnp.int32)
  tree_mixed = jnp.asarray(tree_mixed, bool)
  valid = jnp.asarray(valid, bool)
  aux = (tree, tree_mixed, valid, jnp.asarray(lam, jnp.float32))
  return _greedy(_tree_gain, q, aux, costs, budget, valid, max_per_anchor, budget_unit,
                 cost_aware)
