"""TRACE's stage 1, shared by `trace`, `trace_tree` and `root_only`: p̂ over a candidate pool
decides which prompts get rollouts and how many (`allocators.allocate_roots_subset`), and the
estimates stage 2's predicted allocators read at each anchor.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from trace_jax.allocation import allocators
from trace_jax.allocation.strategies.base import RootPlan, Strategy


class PredictedRoots(Strategy):
  """Stage 1 on p̂: scores a pool of `max(prompts_per_step, candidate_prompts)` prompts and gives
  rollouts to `prompts_per_step` of them, maximizing Σ V_root(p̂_i, m_i) (exact greedy or DP),
  with the forced slots (`forced_slots`) read as p̂ = 0.5. Before the predictor is trusted
  (`use_predictor=False`) the budget goes evenly to the first prompts of the pool. Spends
  `root_budget` at the roots; subclasses decide stage 2."""

  reads_predictor = True
  root_anchors: bool = False  # whether the root of an unmixed tree is a stage-2 anchor

  def prompts_per_step(self) -> int:
    return max(self.cfg.prompts_per_step, self.cfg.candidate_prompts)

  def root_budget(self) -> int:
    return self.cfg.root_budget

  def root_plan(self, driver, examples, use_predictor) -> RootPlan:
    c, p = self.cfg, len(examples)
    n_sel = c.prompts_per_step if 0 < c.prompts_per_step < p else p
    cap = max(c.max_per_prompt, -(-c.root_budget // n_sel))
    if not use_predictor:  # uniform over the first n_sel prompts of the pool
      counts = np.zeros(p, np.int32)
      counts[:n_sel] = np.asarray(_alloc_roots(c.root_budget, c.min_per_prompt, cap)(
          np.full(n_sel, 0.5, np.float32)))
      return RootPlan(counts)
    feats = driver.prompt_features([e["prompt_ids"] for e in examples])
    raw = np.clip(driver.predict(feats), 1e-4, 1 - 1e-4).astype(np.float32)
    p_hat, calibration = driver.calibrated(raw)
    # The forced slots apply whether or not the pool is larger than the step: with every prompt
    # taken, a slot still gives its prompt the share of the budget p̂ = 0.5 would get.
    seen, slots = forced_slots(p_hat, n_sel, c.hard_prompts, c.explore_prompts, driver.rng)
    kappa = mean = None
    lo = c.min_per_prompt if n_sel < p else 0
    if c.root_objective == "binned":  # the Beta of the p̂ bin's past outcomes (paper until any)
      got = driver.binned_beta(p_hat)
      if got is not None:
        mean, kappa = got
        table = np.array(_root_table("binned", lo, cap, c.discovery_beta)(mean, kappa))
        for idx in slots.values():  # a forced slot is worth the most any prompt is
          table[idx] = table.max(axis=0)
    elif c.root_objective != "paper":
      kappa = driver.concentration(feats)
      table = _root_table(c.root_objective, lo, cap, c.discovery_beta)(seen, kappa)
    if n_sel < p:  # choose the prompts as well as their counts
      alloc = _alloc_roots_subset(c.root_budget, n_sel, c.min_per_prompt, cap)
    else:
      alloc = _alloc_roots(c.root_budget, c.min_per_prompt, cap)
    counts = alloc(seen) if kappa is None else alloc(seen, table)
    return RootPlan(np.asarray(counts), p_hat, raw, calibration, slots, kappa, mean)

  def candidates(self, trees):
    """The turn boundaries, and with `root_anchors` (config) the root of every tree whose stage-1
    leaves all agree: a fresh draw there is the only way to flip a tree whose rollouts all took
    the same wrong turn at the first step. With `anchors="before_tool_call"` a turn boundary is an
    anchor only if its stage-1 rollout made another tool call after it (its next turn is not the
    last): a boundary after the last call is past the search that decided the outcome, so a
    continuation there can only re-word the answer, cheaply, which gain per token over-rewards."""
    cands = []
    roots = self.root_anchors and self.cfg.root_anchors
    before_tool = self.cfg.anchors == "before_tool_call"
    for ti, t in enumerate(trees):
      if roots and t.leaves() and not t.mixed:
        cands.append((ti, 0))
      cands += [(ti, n.id) for n in t.nodes if n.parent >= 0 and not n.done and n.children
                and not (before_tool and t.nodes[n.children[0]].done)]
    return cands


def forced_slots(p_hat, n_sel: int, hard_prompts: int, explore_prompts: int, rng):
  """p̂ as stage 1's pool selection sees it, with the step's forced slots read as p̂ = 0.5 (the
  most valuable a prompt can look), so the allocation takes them whatever the head predicts;
  their trees keep their real p̂. Two kinds, both off by default:
  - `hard_prompts` = h: the pool's h lowest-p̂ prompts. Stage 1 seeks mixed groups, and a prompt
    kind the policy has not solved (p ≈ 0.03) is rarely mixed, so on its own stage 1 spends
    little there, and the rare success that teaches that kind comes late. These slots are a
    discovery term: they keep h of the step's prompts on what the head calls hardest.
  - `explore_prompts` = e: e prompts drawn uniformly at random from the rest of the pool. A head
    that has learned a prompt kind fails everywhere never samples it again on its own, and never
    sees the policy learn to solve it; the random slots keep some of the budget on such prompts.
  Returns (p̂ as seen f32[P], {"explored": indices, "hard": indices}, each sorted)."""
  h = min(int(hard_prompts), n_sel)
  e = min(int(explore_prompts), n_sel - h)
  hard = np.sort(np.argsort(p_hat, kind="stable")[:h]).astype(np.int64)
  explored = np.zeros(0, np.int64)
  if e > 0:  # no random number is drawn when off, so earlier runs reproduce exactly
    rest = np.setdiff1d(np.arange(len(p_hat)), hard)
    explored = np.sort(rng.choice(rest, e, replace=False)).astype(np.int64)
  out = np.array(p_hat, np.float32, copy=True)
  out[hard] = 0.5
  out[explored] = 0.5
  return out, {"explored": explored, "hard": hard}


_ANCHOR_POSTERIOR = jax.jit(allocators.anchor_posterior)
_BLEND = jax.jit(allocators.blend_with_outcomes)


def _bucketed(fn, h: int, *arrays, prior: float) -> np.ndarray:
  """fn(*arrays, prior)[:h] with each f32[h] array padded (with its given value) to the next
  power of two (at least 16): the number of candidates changes every step, and an eager or
  exactly-shaped call compiles anew for each count (13 compilations a step at the default size
  before this)."""
  n = max(16, 1 << max(h - 1, 0).bit_length())
  padded = [np.concatenate([np.asarray(a, np.float32), np.full(n - h, v, np.float32)])
            for a, v in arrays]
  return np.asarray(fn(*padded, np.float32(prior)))[:h]


def anchor_estimates(driver, trees, cands, use_predictor):
  """Success estimates of the candidates for stage 2: p̂(h), and with `anchor_posterior` the
  Beta posterior of the tree's stage-1 counts shifted by p̂(h) - p̂(root) (see
  `allocators.anchor_posterior`). Returns (f32[H] estimates, f32[H] the stage-1 outcome each
  candidate's rollout came from)."""
  c = driver.cfg
  h = len(cands)
  used = sorted({ti for ti, _ in cands})
  if use_predictor:
    feats = [trees[ti].nodes[nid].feature for ti, nid in cands]
    feats += [trees[ti].root.feature for ti in used]
    have = [f is not None for f in feats]
    p_all = np.full(len(feats), 0.5, np.float32)
    if any(have):
      p_all[np.asarray(have)] = np.asarray(
          driver.predict(np.stack([f for f in feats if f is not None])), np.float32)
    p_hat, p_root_t = p_all[:h], dict(zip(used, p_all[h:]))
  else:
    p_hat, p_root_t = np.full(h, 0.5, np.float32), {ti: 0.5 for ti in used}
  outcomes = np.asarray([stage1_outcome(trees[ti], nid) for ti, nid in cands], np.float32)
  if c.anchor_posterior:
    succ = {ti: sum(float(x.reward or 0.0) for x in trees[ti].leaves()) for ti in used}
    trials = {ti: float(len(trees[ti].leaves())) for ti in used}
    p_hat = _bucketed(_ANCHOR_POSTERIOR, h, (p_hat, 0.5),
                      (np.asarray([p_root_t[ti] for ti, _ in cands], np.float32), 0.5),
                      (np.asarray([succ[ti] for ti, _ in cands], np.float32), 0.0),
                      (np.asarray([trials[ti] for ti, _ in cands], np.float32), 0.0),
                      prior=c.anchor_prior_strength)
  elif c.blend_prior > 0:
    p_hat = _bucketed(_BLEND, h, (p_hat, 0.5), (outcomes, 0.0), (np.ones(h, np.float32), 0.0),
                      prior=c.blend_prior)
  return np.clip(p_hat, 1e-4, 1 - 1e-4).astype(np.float32), outcomes


def stage1_outcome(tree, node_id: int) -> float:
  """Reward of the (first) leaf below node_id: the stage-1 outcome a prefix came from."""
  n = tree.nodes[node_id]
  while not n.done:
    n = tree.nodes[n.children[0]]
  return float(n.reward or 0.0)


def pad_to(x, size: int, value):
  """`x` padded with `value` to `size` entries, so the jitted allocators compile once per bucket."""
  return np.concatenate([x, np.full(size - len(x), value, x.dtype)])


@functools.lru_cache(maxsize=None)
def _alloc_roots(budget, min_per_prompt, max_per_prompt):
  return jax.jit(lambda p, values=None: allocators.allocate_roots(
      p, budget, min_per_prompt, max_per_prompt, values))


@functools.lru_cache(maxsize=None)
def _alloc_roots_subset(budget, num_selected, min_per_prompt, max_per_prompt):
  return jax.jit(lambda p, values=None: allocators.allocate_roots_subset(
      p, budget, num_selected, min_per_prompt, max_per_prompt, values))


@functools.lru_cache(maxsize=None)
def _root_table(objective, lo, hi, beta):
  """The jitted value table of counts lo..hi (`allocators.root_value_table`)."""
  counts = tuple(range(lo, hi + 1))
  return jax.jit(lambda p, kappa: allocators.root_value_table(p, counts, objective, kappa, beta))
