"""Budget strategies of TRACE, its variants and the baselines, selected by name in the config.

Every strategy spends the same budget in two stages: stage 1 decides how many rollouts each prompt
gets, stage 2 how many continuations each candidate anchor (an internal turn boundary of a finished
stage-1 rollout) gets. The pieces below are pure functions of arrays; the TRACE allocators
themselves live in `allocation.py`.

  name        stage 1 (roots)                        stage 2 (anchors)
  ----------  -------------------------------------  -------------------------------------------
  trace       allocate_roots on predicted p          allocate_prefixes: summed 1 - q_h^k per cost
  trace_tree  allocate_roots                         allocate_prefixes_tree_aware: mixes trees
  root_only   allocate_roots                         uniform_prefixes over all candidates
  grpo        uniform_roots (whole budget at roots)  none
  dapo        uniform_roots, oversampled, then       none
              dapo_select drops all-equal groups
              and charges their cost
  tree_grpo   uniform_roots                          random anchors: every tree expands its own
                                                     uniformly random nodes (the driver)
  arpo        uniform_roots                          after tool results where the next-token
                                                     entropy rose most over the rollout's initial
                                                     entropy (Delta H; the driver)

The predicted stage 2 (trace, trace_tree) also counts the root of a tree whose stage-1 leaves all
agree as an anchor (a fresh draw there).

`ROOT_ALLOCATION` and `PREFIX_ALLOCATION` give the same table as data, for dispatch;
`advantage_for` names the advantage each one trains with.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

STRATEGIES = ("trace", "trace_tree", "root_only", "grpo", "dapo", "tree_grpo", "arpo")

ROOT_ALLOCATION = {
    "trace": "predicted", "trace_tree": "predicted", "root_only": "predicted", "grpo": "uniform",
    "dapo": "uniform_filtered", "tree_grpo": "uniform", "arpo": "uniform",
}
PREFIX_ALLOCATION = {
    "trace": "predicted", "trace_tree": "predicted_tree_aware", "root_only": "uniform",
    "grpo": "none", "dapo": "none", "tree_grpo": "random", "arpo": "entropy",
}


# The advantage each baseline trains with, as its paper defines it. Tree-GRPO: GRPO over the
# prompt's leaves plus GRPO within each initial rollout's subtree (`tree_grpo_advantages`). ARPO:
# GRPO over the prompt's trajectories, a token shared by several of them getting the mean of their
# advantages (its advantage attribution), which is `grpo_advantages` on the tree. DAPO and GRPO:
# GRPO. TRACE's own strategies train with the configured advantage (tree contrastive by default).
OWN_ADVANTAGE = {"grpo": "grpo", "dapo": "grpo", "tree_grpo": "tree_grpo", "arpo": "grpo"}


def advantage_for(method: str, default: str) -> str:
  """The advantage estimator (a key of `trace_jax.rl.batch.ADVANTAGES`) `method` trains with:
  the baselines their papers' own, TRACE's strategies (trace, trace_tree, root_only) `default`."""
  validate_strategy(method)
  return OWN_ADVANTAGE.get(method, default)


def validate_strategy(name: str) -> str:
  """Returns `name` if it is a known strategy, else raises ValueError listing the choices."""
  if name not in STRATEGIES:
    raise ValueError(f"unknown strategy {name!r}; choose one of {STRATEGIES}")
  return name


def uniform_roots(num_prompts: int, budget: int):
  """GRPO's stage 1: the budget split evenly, the remainder to the first prompts. i32[P]."""
  if num_prompts <= 0:
    raise ValueError(f"num_prompts must be positive, got {num_prompts}")
  base, rem = divmod(int(budget), int(num_prompts))
  return base + (jnp.arange(num_prompts) < rem).astype(jnp.int32)


class DapoSelection(NamedTuple):
  """Result of DAPO's dynamic sampling filter.

  keep: bool[G] groups to train on. num_uniform: i32[] groups dropped because every reward was
  equal. num_dropped: i32[] all dropped groups (uniform ones plus mixed ones beyond `max_groups`).
  dropped_rollouts: i32[] valid samples in dropped groups. dropped_cost: f32[] their summed cost.
  """

  keep: jax.Array
  num_uniform: jax.Array
  num_dropped: jax.Array
  dropped_rollouts: jax.Array
  dropped_cost: jax.Array


def dapo_select(rewards_by_group, valid=None, costs=None, max_groups: int | None = None,
                tol: float = 1e-6) -> DapoSelection:
  """DAPO dynamic sampling: keep groups with unequal rewards, counting what was thrown away.

  DAPO oversamples prompts and discards groups with zero reward variance, which carry no GRPO
  signal. The discarded samples were still generated, so their cost goes into the ledger; that is
  what makes the comparison at equal budget honest.

  Args:
    rewards_by_group: f32[G, M] rewards of M samples for each of G groups (prompts).
    valid: optional bool[G, M] sample mask (ragged groups); None means all valid.
    costs: optional f32[G, M] cost of each sample (e.g. generated tokens); None counts 1 per sample.
    max_groups: optional static cap on kept groups (the target batch size); the first mixed groups
      in order are kept, later mixed ones are dropped as overflow.
    tol: rewards closer than this count as equal.

  Returns:
    DapoSelection.
  """
  rewards = jnp.asarray(rewards_by_group, jnp.float32)
  valid = jnp.ones(rewards.shape, bool) if valid is None else jnp.asarray(valid, bool)
  costs = jnp.ones(rewards.shape, jnp.float32) if costs is None else jnp.asarray(costs, jnp.float32)
  hi = jnp.max(jnp.where(valid, rewards, -jnp.inf), axis=1)
  lo = jnp.min(jnp.where(valid, rewards, jnp.inf), axis=1)
  present = jnp.any(valid, axis=1)
  mixed = present & (hi - lo > tol)
  keep = mixed
  if max_groups is not None:
    keep = mixed & (jnp.cumsum(mixed) <= max_groups)
  dropped = present & ~keep
  dropped_samples = dropped[:, None] & valid
  return DapoSelection(
      keep=keep,
      num_uniform=jnp.sum(present & ~mixed).astype(jnp.int32),
      num_dropped=jnp.sum(dropped).astype(jnp.int32),
      dropped_rollouts=jnp.sum(dropped_samples).astype(jnp.int32),
      dropped_cost=jnp.sum(jnp.where(dropped_samples, costs, 0.0)),
  )


def _top_n(scores, n: int):
  """Indices of the n largest scores and whether each is a real pick (score > -inf)."""
  n = min(int(n), scores.shape[0])
  top, idx = jax.lax.top_k(scores, n)
  return idx, top > -jnp.inf


def _counts_from_picks(size, idx, ok, branches):
  return jnp.zeros((size,), jnp.int32).at[idx].add(jnp.where(ok, branches, 0))


def random_anchors(rng, valid, n: int, branches_per_anchor: int = 1):
  """Tree-GRPO's stage 2: n distinct anchors drawn uniformly among the valid candidates.

  Args:
    rng: PRNG key.
    valid: bool[H] candidate mask.
    n: static number of anchors (fewer when fewer candidates are valid).
    branches_per_anchor: continuations from each chosen anchor.

  Returns:
    i32[H] continuation counts.
  """
  valid = jnp.asarray(valid, bool)
  scores = jnp.where(valid, jax.random.uniform(rng, valid.shape), -jnp.inf)
  idx, ok = _top_n(scores, n)
  return _counts_from_picks(valid.shape[0], idx, ok, branches_per_anchor)


def entropy_anchors(entropy, valid, threshold: float | None = None, top_n: int | None = None,
                    branches_per_anchor: int = 1):
  """ARPO's stage 2: branch after tool calls where the policy is uncertain.

  ARPO samples extra branches right after a tool result when the next-token entropy rises, since
  that is where the rollout's direction is most open. Candidates are the turn boundaries after an
  observation; `entropy` is the entropy of the first token the policy would generate there.

  Args:
    entropy: f32[H] next-token entropy at each candidate.
    valid: bool[H] candidate mask (e.g. only boundaries right after a tool call).
    threshold: branch where entropy > threshold.
    top_n: static; branch at the top_n highest-entropy candidates (above `threshold` if both given).
    branches_per_anchor: continuations from each chosen anchor.

  Returns:
    i32[H] continuation counts.
  """
  if threshold is None and top_n is None:
    raise ValueError("entropy_anchors needs a threshold, a top_n, or both")
  entropy = jnp.asarray(entropy, jnp.float32)
  ok = jnp.asarray(valid, bool)
  if threshold is not None:
    ok = ok & (entropy > threshold)
  if top_n is None:
    return jnp.where(ok, branches_per_anchor, 0).astype(jnp.int32)
  idx, picked = _top_n(jnp.where(ok, entropy, -jnp.inf), top_n)
  return _counts_from_picks(entropy.shape[0], idx, picked, branches_per_anchor)


def uniform_prefixes(valid, budget, rng=None):
  """root_only's stage 2: the budget spread evenly over valid candidates.

  The remainder goes one each to the first valid candidates in order, or, given `rng`, to a
  uniformly random subset (so it does not always favor the first trees of a batch).

  Args:
    valid: bool[H] candidate mask.
    budget: number of continuations (may be traced).
    rng: optional PRNG key.

  Returns:
    i32[H] continuation counts summing to budget (0 everywhere when nothing is valid).
  """
  valid = jnp.asarray(valid, bool)
  budget = jnp.asarray(budget, jnp.int32)
  num_valid = jnp.sum(valid).astype(jnp.int32)
  safe = jnp.maximum(num_valid, 1)
  base, rem = budget // safe, budget % safe
  if rng is None:
    rank = jnp.cumsum(valid) - 1
  else:
    keys = jnp.where(valid, jax.random.uniform(rng, valid.shape), 2.0)
    order = jnp.argsort(keys)
    rank = jnp.zeros(valid.shape, jnp.int32).at[order].set(jnp.arange(valid.shape[0]))
  return jnp.where(valid, base + (rank < rem), 0).astype(jnp.int32)
