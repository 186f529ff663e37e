"""Where to spend the sampling budget: TRACE stage 1 (roots) and stage 2 (prefixes).

All allocators are pure, jittable functions of arrays. Each returns integer counts of new
rollouts (stage 1: per prompt) or continuations (stage 2: per candidate anchor).

Stage 1 maximizes sum_i V_root(p_i, m_i) with V_root(p, m) = 1 - p^m - (1 - p)^m, the chance that m
independent rollouts of a prompt with success probability p are mixed. Stage 2 values k
continuations from an anchor h, whose rollout ended with outcome r, by V_pref(h, k) = 1 - q_h^k,
where q_h = r p_h + (1 - r)(1 - p_h) is the chance that one continuation repeats r.

The greedy loops run one pick per iteration, O(num_candidates) work each; budgets are hundreds to a
few thousand picks, which is cheap next to sampling a single token.

This module gathers them under one name; they live by responsibility in `root_values` (stage 1's
value tables), `root_allocators` (stage 1), `prefix_allocators` (stage 2) and `estimates` (the
success estimates they read: posterior blends, Platt calibration).
"""

from trace_jax.allocation.estimates import (anchor_posterior, blend_with_outcomes, platt_apply,
                                            platt_fit)
from trace_jax.allocation.prefix_allocators import (allocate_prefixes,
                                                    allocate_prefixes_tree_aware, prefix_objective,
                                                    repeat_prob, tree_aware_objective)
from trace_jax.allocation.root_allocators import allocate_roots, allocate_roots_subset
from trace_jax.allocation.root_values import (ROOT_OBJECTIVES, beta_params, binned_root_beta,
                                              concentration_from_spread, information_gain,
                                              root_value, root_value_posterior, root_value_table)
# The module-level jitted programs, whose compilation caches a test reads through this module.
from trace_jax.allocation.prefix_allocators import _greedy_program as _greedy_program
from trace_jax.allocation.root_allocators import _greedy_roots as _greedy_roots
from trace_jax.allocation.root_allocators import _subset_program as _subset_program

__all__ = ["ROOT_OBJECTIVES", "allocate_prefixes", "allocate_prefixes_tree_aware",
           "allocate_roots", "allocate_roots_subset", "anchor_posterior", "beta_params",
           "binned_root_beta", "blend_with_outcomes", "concentration_from_spread",
           "information_gain", "platt_apply", "platt_fit", "prefix_objective", "repeat_prob",
           "root_value", "root_value_posterior", "root_value_table", "tree_aware_objective"]
