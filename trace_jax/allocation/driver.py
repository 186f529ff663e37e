"""One RL step's sampling: stage 1 over prompt roots, stage 2 over turn-boundary anchors.

Host logic around the sampler engine: asks the predictor for p̂ where a strategy needs it, calls the
pure allocators (`allocation.py`, `strategies.py`), issues prompt and fork requests, and records
every allocation-time prediction with the outcomes that followed (for honest predictor metrics).
All strategies draw from one budget of rollouts (`root_budget + prefix_budget`, a continuation
from an anchor counts as one rollout); the engine's ledger counts generated and prefill tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import numpy as np

from trace_jax.allocation import predictor_metrics
from trace_jax.allocation import allocators as allocation, strategies
from trace_jax.sampling.engine import ForkRequest, PromptRequest, SamplerEngine
from trace_jax.sampling.tree import Tree


@dataclasses.dataclass(frozen=True)
class DriverConfig:
  method: str = "trace_tree"
  root_budget: int = 96
  prefix_budget: int = 32
  min_per_prompt: int = 2
  max_per_prompt: int = 12
  prompts_per_step: int = 0   # predicted roots: prompts given rollouts out of a larger pool (0 = all)
  max_per_anchor: int = 4
  budget_unit: str = "rollouts"   # rollouts | tokens (see `_prefix_counts`)
  cost_aware: bool = True         # tokens: rank anchors by gain per expected token (else by gain)
  tree_lambda: float = 0.1
  blend_prior: float = 0.0        # per-anchor blend with its own outcome (superseded by the below)
  anchor_posterior: bool = True   # q from a Beta posterior of the tree's stage-1 counts and p̂
  anchor_prior_strength: float = 4.0  # s of that posterior's prior Beta(s p̂(root), s(1 - p̂(root)))
  root_anchors: bool = True       # predicted stage 2: the root of an unmixed tree is an anchor
  explore_prompts: int = 0        # predicted roots: of the prompts_per_step, this many drawn at
  #                                 random from the pool and allocated as if p̂ = 0.5 (0 = off)
  hard_prompts: int = 0           # predicted roots: of the prompts_per_step, the pool's this many
  #                                 lowest-p̂ prompts, allocated as if p̂ = 0.5 (0 = off)
  metric_slice: int = 8           # predicted roots: random pool prompts measured per step (0 = off)
  metric_rollouts: int = 2        # rollouts per measured prompt (outside the budget, not trained)
  dapo_oversample: float = 1.5
  arpo_entropy_top: float = 0.25
  calibrate: str = "none"         # none | platt: stage 1 uses p̂ recalibrated on the random slice's
  calibrate_window: int = 8       # outcomes of the last this many steps (needs metric_slice > 0),
  calibrate_prior: float = 10.0   # with the identity map worth this many pairs


@dataclasses.dataclass
class StepSample:
  trees: list            # trees to train on
  all_trees: list        # every tree sampled (dapo: dropped groups too)
  predictions: list      # (stage, p_hat, outcome) for every rollout allocated by prediction
  info: dict
  slice_predictions: list = dataclasses.field(default_factory=list)  # ("slice", p_hat, outcome)


def _outcome(tree: Tree, node_id: int) -> float:
  """Reward of the (first) leaf below node_id: the stage-1 outcome a prefix came from."""
  n = tree.nodes[node_id]
  while not n.done:
    n = tree.nodes[n.children[0]]
  return float(n.reward or 0.0)


class RolloutDriver:
  """`sample(examples, use_predictor)`; examples are dicts with prompt_ids, answers, question..."""

  def __init__(self, engine: SamplerEngine, cfg: DriverConfig,
               predict: Callable[[np.ndarray], np.ndarray],
               prompt_features: Callable[[Sequence[Sequence[int]]], np.ndarray], seed: int = 0):
    strategies.validate_strategy(cfg.method)
    self.engine, self.cfg, self.predict = engine, cfg, predict
    self.prompt_features = prompt_features
    self.rng = np.random.default_rng(seed)
    self._slice_log: list[list] = []  # per step: the random slice's (stage, p̂, outcome)

  def state_dict(self) -> dict:
    """What the driver carries from step to step (for a checkpoint): the random slice's
    (stage, raw p̂, outcome) records per step, which the Platt calibration and the running slice
    metrics read."""
    return {"slice_log": [[list(x) for x in step] for step in self._slice_log]}

  def load_state_dict(self, d: dict) -> None:
    self._slice_log[:] = [[(st, float(p), float(y)) for st, p, y in step]
                          for step in d.get("slice_log", [])]

  # ---- stage 1 -----------------------------------------------------------------------------------
  def _root_counts(self, examples, use_predictor):
    """Stage-1 rollouts per prompt. Returns (counts, p̂ used, raw p̂, Platt (a, b), slots): the
    p̂ the allocation used (calibrated when `calibrate` is on), the head's own p̂ before
    calibration, the calibration map, and the pool indices of the step's forced slots
    (`_forced_slots`: {"explored": ..., "hard": ...}, each sorted, empty when off); the p̂s are
    None when the allocation does not read the predictor."""
    c, p = self.cfg, len(examples)
    none = np.zeros(0, np.int64)
    identity, no_slots = (1.0, 0.0), {"explored": none, "hard": none}
    kind = strategies.ROOT_ALLOCATION[c.method]
    if kind == "predicted":
      n_sel = c.prompts_per_step if 0 < c.prompts_per_step < p else p
      cap = max(c.max_per_prompt, -(-c.root_budget // n_sel))
      if not use_predictor:  # uniform over the first n_sel prompts of the pool
        m = np.zeros(p, np.int32)
        m[:n_sel] = np.asarray(_alloc_roots(c.root_budget, c.min_per_prompt, cap)(
            np.full(n_sel, 0.5, np.float32)))
        return m, None, None, identity, no_slots
      raw = np.clip(self.predict(self.prompt_features([e["prompt_ids"] for e in examples])),
                    1e-4, 1 - 1e-4).astype(np.float32)
      p_hat, calib = self._calibrated(raw)
      # The forced slots apply whether or not the pool is larger than the step: with every prompt
      # taken, a slot still gives its prompt the share of the budget p̂ = 0.5 would get.
      seen, slots = self._forced_slots(p_hat, n_sel)
      if n_sel < p:  # choose the prompts as well as their counts
        m = _alloc_roots_subset(c.root_budget, n_sel, c.min_per_prompt, cap)(seen)
      else:
        m = _alloc_roots(c.root_budget, c.min_per_prompt, cap)(seen)
      return np.asarray(m), p_hat, raw, calib, slots
    if len(examples) > c.prompts_per_step > 0 and c.method != "dapo":
      raise ValueError(f"{c.method} samples every prompt it is given: pass prompts_per_step "
                       f"({c.prompts_per_step}) prompts, not {len(examples)}")
    budget = c.root_budget if kind == "uniform" and c.method != "grpo" else \
        c.root_budget + c.prefix_budget
    return np.asarray(strategies.uniform_roots(p, budget)), None, None, identity, no_slots

  def _forced_slots(self, p_hat, n_sel):
    """p̂ as stage 1's pool selection sees it, with the step's forced slots read as p̂ = 0.5 (the
    most valuable a prompt can look), so the allocation takes them whatever the head predicts;
    their trees keep their real p̂ (`sample`). Two kinds, both off by default:
    - `hard_prompts` = h: the pool's h lowest-p̂ prompts. Stage 1 seeks mixed groups, and a prompt
      kind the policy has not solved (p ≈ 0.03) is rarely mixed, so on its own stage 1 spends
      little there, and the rare success that teaches that kind comes late. These slots are a
      discovery term: they keep h of the step's prompts on what the head calls hardest.
    - `explore_prompts` = e: e prompts drawn uniformly at random from the rest of the pool. A head
      that has learned a prompt kind fails everywhere never samples it again on its own, and never
      sees the policy learn to solve it; the random slots keep some of the budget on such prompts.
    Returns (p̂ as seen, {"explored": indices, "hard": indices}, each sorted)."""
    h = min(int(self.cfg.hard_prompts), n_sel)
    e = min(int(self.cfg.explore_prompts), n_sel - h)
    hard = np.sort(np.argsort(p_hat, kind="stable")[:h]).astype(np.int64)
    explored = np.zeros(0, np.int64)
    if e > 0:  # no random number is drawn when off, so earlier runs reproduce exactly
      rest = np.setdiff1d(np.arange(len(p_hat)), hard)
      explored = np.sort(self.rng.choice(rest, e, replace=False)).astype(np.int64)
    out = np.array(p_hat, np.float32, copy=True)
    out[hard] = 0.5
    out[explored] = 0.5
    return out, {"explored": explored, "hard": hard}

  # ---- stage 2 -----------------------------------------------------------------------------------
  def _candidates(self, trees):
    """Stage-2 anchors: (tree index, node id). Internal turn boundaries of the stage-1 chains, and,
    for the predicted strategies with `root_anchors`, the root of every tree whose stage-1 leaves
    all agree (a fresh draw there is the only way to flip a tree whose rollouts all took the same
    wrong turn at the first step)."""
    roots = self.cfg.root_anchors and \
        strategies.PREFIX_ALLOCATION[self.cfg.method].startswith("predicted")
    cands = []
    for ti, t in enumerate(trees):
      if roots and t.leaves() and not t.mixed:
        cands.append((ti, 0))
      for n in t.nodes:
        if n.parent >= 0 and not n.done and n.children:
          cands.append((ti, n.id))
    return cands

  @staticmethod
  def _remaining_cost(trees) -> dict[int, float]:
    """Expected generated tokens of a continuation from an anchor at depth d (0 = the root: a whole
    rollout), averaged over this step's stage-1 rollouts that pass depth d, i.e. that still had a
    turn to generate after it (a rollout that ends at depth d is a leaf there, not an anchor)."""
    per_depth: dict[int, list[float]] = {}
    for t in trees:
      for leaf in t.leaves():
        path = t.path(leaf.id)
        gen = [len(t.nodes[i].gen_ids) for i in path]
        for d in range(len(path) - 1):  # path[-1] is the leaf
          per_depth.setdefault(d, []).append(float(sum(gen[d + 1:])))
    return {d: max(float(np.mean(v)), 1.0) for d, v in per_depth.items()}

  def _estimates(self, trees, cands, use_predictor):
    """Success estimates of the candidates for stage 2: p̂(h), and with `anchor_posterior` the
    Beta posterior of the tree's stage-1 counts shifted by p̂(h) - p̂(root) (see
    `allocation.anchor_posterior`). Returns f32[H]."""
    c = self.cfg
    h = len(cands)
    used = sorted({ti for ti, _ in cands})
    if use_predictor:
      feats = [trees[ti].nodes[nid].feature for ti, nid in cands]
      feats += [trees[ti].root.feature for ti in used]
      have = [f is not None for f in feats]
      p_all = np.full(len(feats), 0.5, np.float32)
      if any(have):
        p_all[np.asarray(have)] = np.asarray(
            self.predict(np.stack([f for f in feats if f is not None])), np.float32)
      p_hat, p_root_t = p_all[:h], dict(zip(used, p_all[h:]))
    else:
      p_hat, p_root_t = np.full(h, 0.5, np.float32), {ti: 0.5 for ti in used}
    outcomes = np.asarray([_outcome(trees[ti], nid) for ti, nid in cands], np.float32)
    if c.anchor_posterior:
      succ = {ti: sum(float(x.reward or 0.0) for x in trees[ti].leaves()) for ti in used}
      trials = {ti: float(len(trees[ti].leaves())) for ti in used}
      p_hat = np.asarray(allocation.anchor_posterior(
          p_hat, np.asarray([p_root_t[ti] for ti, _ in cands], np.float32),
          np.asarray([succ[ti] for ti, _ in cands], np.float32),
          np.asarray([trials[ti] for ti, _ in cands], np.float32), c.anchor_prior_strength))
    elif c.blend_prior > 0:
      p_hat = np.asarray(allocation.blend_with_outcomes(p_hat, outcomes, np.ones(h),
                                                        c.blend_prior))
    return np.clip(p_hat, 1e-4, 1 - 1e-4).astype(np.float32), outcomes

  def _prefix_counts(self, trees, cands, use_predictor):
    """Continuations per candidate, and the success estimates the allocation used (or None).

    budget_unit="rollouts": `prefix_budget` continuations, ranked by marginal gain per rollout.
    budget_unit="tokens": stage 2 gets the generated tokens `prefix_budget` fresh rollouts would
    cost (the mean whole-rollout length of this step's stage 1, times prefix_budget), so a method
    whose continuations start deep, hence are short, gets more of them: the step then spends about
    the generated tokens of uniform GRPO with root_budget + prefix_budget rollouts. The predicted
    allocators spend it anchor by anchor at each anchor's expected cost (ranked by gain per
    expected token when `cost_aware`); the baselines' rules get as many continuations as the
    tokens buy at their candidates' mean cost.
    """
    c = self.cfg
    kind = strategies.PREFIX_ALLOCATION[c.method]
    h = len(cands)
    if kind == "none" or h == 0 or c.prefix_budget <= 0:
      return np.zeros(h, np.int32), None
    cost_by_depth = self._remaining_cost(trees)
    costs = np.asarray([cost_by_depth.get(trees[ti].nodes[nid].depth, 1.0) for ti, nid in cands],
                       np.float32)
    tokens = c.budget_unit == "tokens"
    token_budget = float(c.prefix_budget * cost_by_depth.get(0, float(np.mean(costs))))
    n_cont = c.prefix_budget
    if tokens:
      n_cont = max(1, int(round(token_budget / float(np.mean(costs)))))
    valid = np.ones(h, bool)
    if kind == "uniform":
      key = jax.random.key(int(self.rng.integers(2**31)))
      return np.asarray(strategies.uniform_prefixes(valid, n_cont, key)), None
    if kind == "random":
      return self._tree_grpo_counts(trees, cands, n_cont), None
    if kind == "entropy":
      return self._arpo_counts(trees, cands, n_cont), None
    p_hat, outcomes = self._estimates(trees, cands, use_predictor)
    budget = token_budget if tokens else c.prefix_budget
    cost_aware = bool(c.cost_aware and tokens)
    # Pad candidates (and trees) to buckets so the jitted allocators compile once per bucket.
    hp = -(-h // 64) * 64
    padf = lambda x, v: np.concatenate([x, np.full(hp - h, v, x.dtype)])  # noqa: E731
    args = (padf(p_hat, 0.5), padf(outcomes, 0.0), padf(costs, 1.0))
    if kind == "predicted":
      k = _alloc_prefixes(c.max_per_anchor, c.budget_unit, cost_aware)(
          *args, budget, padf(valid, False))
    else:
      tree_ids = np.asarray([ti for ti, _ in cands], np.int32)
      tp = -(-len(trees) // 16) * 16
      mixed = np.zeros(tp, bool)
      mixed[:len(trees)] = [t.mixed for t in trees]
      k = _alloc_tree_aware(c.max_per_anchor, c.budget_unit, c.tree_lambda, cost_aware)(
          *args, padf(tree_ids, 0), mixed, budget, padf(valid, False))
    return np.asarray(k)[:h], p_hat

  def _tree_grpo_counts(self, trees, cands, n_cont):
    """Tree-GRPO's expansion: every tree expands randomly chosen nodes of its own. The
    continuations are split evenly over the trees that have candidates (the remainder to random
    ones); within a tree each goes to a uniformly random anchor, distinct anchors first, at most
    `max_per_anchor` each while room remains."""
    c = self.cfg
    by_tree: dict[int, list[int]] = {}
    for j, (ti, _) in enumerate(cands):
      by_tree.setdefault(ti, []).append(j)
    tids = list(by_tree)
    share = np.full(len(tids), n_cont // len(tids), np.int64)
    share[self.rng.permutation(len(tids))[:n_cont % len(tids)]] += 1
    k = np.zeros(len(cands), np.int32)
    left = 0
    for ti, n in zip(tids, share):
      js = np.asarray(by_tree[ti])
      kt = _round_robin(js[self.rng.permutation(len(js))], len(cands), int(n), c.max_per_anchor)
      k += kt
      left += int(n) - int(kt.sum())
    if left:  # trees whose anchors are all at the cap pass their share on
      k += _round_robin(self.rng.permutation(len(cands)), len(cands), left, c.max_per_anchor,
                        start=k)
    return k

  def _arpo_counts(self, trees, cands, n_cont):
    """ARPO's entropy-triggered branching: after a tool result, the rise of the next-token entropy
    over the rollout's initial entropy (ARPO's Delta H) says where the trajectory is most open.
    The top `arpo_entropy_top` share of anchors by Delta H branch, the continuations spread over
    them round-robin in Delta H order, at most `max_per_anchor` each; when those caps bind, the
    next anchors by Delta H take the rest."""
    c = self.cfg

    def first_entropy(t, nid):
      n = t.nodes[t.nodes[nid].children[0]]
      return n.entropies[0] if n.entropies else 0.0

    def initial_entropy(t, nid):  # the first token of the rollout through nid
      n = t.nodes[t.path(nid)[1]]
      return n.entropies[0] if n.entropies else 0.0

    dh = np.asarray([first_entropy(trees[ti], nid) - initial_entropy(trees[ti], nid)
                     for ti, nid in cands], np.float32)
    h = len(cands)
    n_anchor = max(1, int(round(c.arpo_entropy_top * h)))
    order = np.argsort(-dh, kind="stable")
    return _round_robin(order, h, n_cont, c.max_per_anchor, first=n_anchor)

  # ---- one step ----------------------------------------------------------------------------------
  def sample(self, examples: list[dict], use_predictor: bool = True) -> StepSample:
    c = self.cfg
    ledger0 = dict(self.engine.ledger.as_dict())
    if c.method == "dapo":
      return self._sample_dapo(examples, ledger0)
    m, p_root, raw_p_root, calib, slots = self._root_counts(examples, use_predictor)
    reqs = [PromptRequest(e["prompt_ids"], int(k), meta=e) for e, k in zip(examples, m) if k > 0]
    trees = self.engine.run(reqs)
    kept = np.flatnonzero(m > 0)  # pool index of each tree
    for t, i in zip(trees, kept):  # stage-1 rollouts of the tree (stage 2 may add more at the root)
      t.meta["stage1_rollouts"] = len(t.leaves())
      for kind, idx in slots.items():  # taken by a forced slot (`_forced_slots`)
        if len(idx):
          t.meta[kind] = bool(np.isin(i, idx))
    predictions = []
    if p_root is not None and use_predictor:
      p_kept = [p for p, k in zip(p_root, m) if k > 0]
      for t, p in zip(trees, p_kept):
        t.root.p_hat = float(p)
        predictions += [("root", float(p), float(l.reward or 0.0)) for l in t.leaves()]
    stage1_leaves = sum(len(t.leaves()) for t in trees)
    stage1_mixed = float(np.mean([t.mixed for t in trees])) if trees else float("nan")
    extra = {}
    if trees:  # what the unmixed trees are: all failed, or all succeeded
      best = [max((float(l.reward or 0.0) for l in t.leaves()), default=0.0) for t in trees]
      worst = [min((float(l.reward or 0.0) for l in t.leaves()), default=0.0) for t in trees]
      extra["stage1_all_fail"] = float(np.mean([b <= 0.5 for b in best]))
      extra["stage1_all_success"] = float(np.mean([w > 0.5 for w in worst]))
    if p_root is not None and use_predictor:  # what stage 1 expected, next to what it got
      sel = m > 0
      extra["stage1_predicted_mixed"] = float(np.mean(allocation.root_value(p_root[sel], m[sel])))
      if not sel.all():
        extra["pool_p_hat_selected"] = float(np.mean(p_root[sel]))
        extra["pool_p_hat_left_out"] = float(np.mean(p_root[~sel]))
        for kind, idx in slots.items():
          if len(idx):
            extra[f"pool_p_hat_{kind}"] = float(np.mean(p_root[idx]))
    cands = self._candidates(trees)
    k, p_pref = self._prefix_counts(trees, cands, use_predictor)
    forks = []
    before = {}
    unmixed = [not t.mixed for t in trees]  # stage-1 state, once per tree
    extra["continuations_unmixed_trees"] = int(sum(kk for (ti, _), kk in zip(cands, k)
                                                   if unmixed[ti]))
    extra["continuations_at_roots"] = int(sum(kk for (_, nid), kk in zip(cands, k) if nid == 0))
    depths = [trees[ti].nodes[nid].depth for ti, nid in cands]
    extra["anchor_depth_mean"] = float(np.average(depths, weights=k)) if k.sum() else float("nan")
    for d in range(4):  # where stage 2 spends: continuations by anchor depth (3 = 3 and deeper)
      extra[f"continuations_depth{d}"] = int(sum(kk for dd, kk in zip(depths, k)
                                                 if min(dd, 3) == d))
    for j, ((ti, nid), kk) in enumerate(zip(cands, k)):
      if p_pref is not None and nid != 0:  # the root keeps its stage-1 p̂
        trees[ti].nodes[nid].p_hat = float(p_pref[j])
      if kk > 0:
        before[(ti, nid)] = set(trees[ti].nodes[nid].children)
        forks.append(ForkRequest(trees[ti], nid, int(kk)))
    slice_reqs, slice_p = self._slice_requests(
        examples, raw_p_root, use_predictor)
    if forks or slice_reqs:
      # The measured slice shares the stage-2 run, whose slots are mostly idle anyway; its cost is
      # taken out of this step's ledger below.
      out = self.engine.run(forks + slice_reqs)
      slice_trees = out[len(out) - len(slice_reqs):] if slice_reqs else []
    else:
      slice_trees = []
    if p_pref is not None and use_predictor:
      for j, (ti, nid) in enumerate(cands):
        if (ti, nid) in before:
          t = trees[ti]
          stage = "root_anchor" if nid == 0 else "prefix"
          for ch in set(t.nodes[nid].children) - before[(ti, nid)]:
            predictions += [(stage, float(p_pref[j]), float(l.reward or 0.0))
                            for l in _leaves_under(t, ch)]
    for t in trees:
      t.backup()
    slice_preds, slice_info = self._record_slice(slice_trees, slice_p)
    if c.calibrate == "platt" and p_root is not None:
      slice_info.update(calib_a=calib[0], calib_b=calib[1])
    ledger = {k2: v - ledger0.get(k2, 0) for k2, v in self.engine.ledger.as_dict().items()}
    if slice_trees:
      cost = _trees_cost(slice_trees)
      for k2, v in cost.items():
        ledger[k2] -= v
      slice_info.update({f"slice_{k2}": v for k2, v in cost.items()})
      self.engine.release(slice_trees)
    info = dict(stage1_mixed=stage1_mixed, stage1_leaves=stage1_leaves, candidates=len(cands),
                anchors_used=int((k > 0).sum()), continuations=int(k.sum()),
                root_counts_std=float(np.std(m[m > 0])) if (m > 0).any() else 0.0,
                prompts_sampled=int((m > 0).sum()), prompts_scored=len(examples), **extra,
                **slice_info, **{f"ledger_{a}": b for a, b in ledger.items()})
    return StepSample(trees=trees, all_trees=trees, predictions=predictions, info=info,
                      slice_predictions=slice_preds)

  def _calibrated(self, p_hat):
    """(p̂ mapped through a Platt fit, (a, b)): the fit is on the random slice's (raw p̂, outcome)
    pairs of the last `calibrate_window` steps, unbiased since the slice is drawn without looking
    at p̂. Without calibration or slice data yet: (p̂, (1, 0))."""
    c = self.cfg
    if c.calibrate != "platt" or not self._slice_log:
      return p_hat, (1.0, 0.0)
    pairs = [x for step in self._slice_log[-c.calibrate_window:] for x in step]
    calib = allocation.platt_fit(np.asarray([x[1] for x in pairs]),
                                 np.asarray([x[2] for x in pairs]), c.calibrate_prior)
    return allocation.platt_apply(p_hat, *calib), calib

  # ---- online predictor metrics on a random slice of the pool ------------------------------------
  def _slice_requests(self, examples, p_root, use_predictor):
    """A uniformly random slice of the scored pool, sampled outside the budget (not trained on):
    the allocation picks prompts near p̂ = 0.5, which hides how well p̂ ranks prompts, so its
    ranking quality is measured here, on prompts chosen without looking at p̂."""
    c = self.cfg
    if p_root is None or not use_predictor or c.metric_slice <= 0 or c.metric_rollouts <= 0:
      return [], []
    idx = self.rng.choice(len(examples), min(c.metric_slice, len(examples)), replace=False)
    reqs = [PromptRequest(examples[i]["prompt_ids"], int(c.metric_rollouts),
                          meta=dict(examples[i], metric_slice=True)) for i in idx]
    return reqs, [float(p_root[i]) for i in idx]

  def _record_slice(self, slice_trees, slice_p):
    """Per-rollout (p̂, outcome) of the slice, and the slice metrics so far in the run: AUC, Brier
    and calibration over all slice rollouts, the same over the last 5 steps, and p̂ stratified by
    outcome (its mean over successes and over failures)."""
    preds = [("slice", p, float(x.reward or 0.0)) for t, p in zip(slice_trees, slice_p)
             for x in t.leaves()]
    if not preds:
      return [], {}
    self._slice_log.append(preds)
    info = {}
    for name, steps in (("", self._slice_log), ("_recent", self._slice_log[-5:])):
      p = np.asarray([x[1] for s in steps for x in s])
      y = np.asarray([x[2] for s in steps for x in s])
      rep = predictor_metrics.predictor_report(p, y)
      info.update({f"slice_auc{name}": rep["auc"], f"slice_brier{name}": rep["brier"],
                   f"slice_ece{name}": rep["ece"], f"slice_n{name}": int(rep["n"])})
      if not name:
        info.update(predictor_metrics.stratified_by_outcome(p, y, prefix="slice_"))
        cc = predictor_metrics.calibration_curve(p, y, n_bins=5)
        for b in range(5):  # the run's reliability diagram so far, in the per-step metrics
          info[f"slice_calib{b}_n"] = float(cc["count"][b])
          info[f"slice_calib{b}_pred"] = float(cc["mean_pred"][b])
          info[f"slice_calib{b}_outcome"] = float(cc["mean_outcome"][b])
    return preds, info


  def _sample_dapo(self, examples, ledger0) -> StepSample:
    """Equal-budget DAPO: the caller passes oversampled prompts (`dapo_prompts`); the budget is
    split over all of them in nearly equal groups and uniform groups are dropped (cost kept)."""
    c = self.cfg
    total = c.root_budget + c.prefix_budget
    n_prompts = min(len(examples), total // 2)
    base, rem = divmod(total, n_prompts)
    sizes = [base + (i < rem) for i in range(n_prompts)]  # the whole budget, nearly equal groups
    chosen = examples[:n_prompts]
    trees = self.engine.run([PromptRequest(e["prompt_ids"], g, meta=e)
                             for e, g in zip(chosen, sizes) if g > 0])
    for t in trees:
      t.backup()
    kept = [t for t in trees if t.mixed]
    ledger = {k2: v - ledger0.get(k2, 0) for k2, v in self.engine.ledger.as_dict().items()}
    info = dict(stage1_mixed=float(np.mean([t.mixed for t in trees])),
                stage1_leaves=sum(len(t.leaves()) for t in trees), candidates=0,
                anchors_used=0, continuations=0, dapo_dropped_groups=len(trees) - len(kept),
                dapo_dropped_rollouts=sum(len(t.leaves()) for t in trees if not t.mixed),
                **{f"ledger_{a}": b for a, b in ledger.items()})
    return StepSample(trees=kept, all_trees=trees, predictions=[], info=info)


@functools.lru_cache(maxsize=None)
def _alloc_roots(budget, min_per_prompt, max_per_prompt):
  return jax.jit(lambda p: allocation.allocate_roots(p, budget, min_per_prompt, max_per_prompt))


@functools.lru_cache(maxsize=None)
def _alloc_roots_subset(budget, num_selected, min_per_prompt, max_per_prompt):
  return jax.jit(lambda p: allocation.allocate_roots_subset(p, budget, num_selected,
                                                            min_per_prompt, max_per_prompt))


@functools.lru_cache(maxsize=None)
def _alloc_prefixes(max_per_anchor, budget_unit, cost_aware):
  return jax.jit(lambda p, o, c, b, v: allocation.allocate_prefixes(
      p, o, c, b, v, max_per_anchor, budget_unit=budget_unit, cost_aware=cost_aware))


@functools.lru_cache(maxsize=None)
def _alloc_tree_aware(max_per_anchor, budget_unit, lam, cost_aware):
  return jax.jit(lambda p, o, c, t, m, b, v: allocation.allocate_prefixes_tree_aware(
      p, o, c, t, m, b, v, max_per_anchor, lam, budget_unit=budget_unit, cost_aware=cost_aware))


def dapo_prompts(prompts_per_step: int, oversample: float) -> int:
  """How many prompts DAPO samples per step to keep about `prompts_per_step` mixed groups."""
  return max(prompts_per_step, int(round(prompts_per_step * oversample)))


def _leaves_under(tree: Tree, node_id: int):
  stack, out = [node_id], []
  while stack:
    n = tree.nodes[stack.pop()]
    if n.done:
      out.append(n)
    stack.extend(n.children)
  return out


def _trees_cost(trees) -> dict[str, int]:
  """What sampling `trees` from their prompts cost, in the ledger's terms: rollouts started,
  generated tokens, prefill tokens (the prompt but its pending last token, then every
  observation) and tool calls (every turn but those cut before the environment ran)."""
  turns = [n for t in trees for n in t.nodes[1:]]
  return dict(rollouts_started=sum(len(t.leaves()) for t in trees),
              generated_tokens=sum(len(n.gen_ids) for n in turns),
              prefill_tokens=sum(len(t.prompt_ids) - 1 for t in trees) +
              sum(len(n.obs_ids) for n in turns),
              tool_calls=sum(n.truncated not in ("max_seq_len", "pool_exhausted") for n in turns))


def _round_robin(order, size: int, budget: int, cap: int, first: int | None = None,
                 start=None) -> np.ndarray:
  """Hands `budget` units one at a time round-robin over the first `first` indices of `order`
  (all of them by default), none above `cap`; when all of those are full, the next index of
  `order` joins. Returns the units added on top of `start` (i32[size]); fewer than `budget` only
  when every index is full."""
  k = np.zeros(size, np.int32) if start is None else np.asarray(start, np.int32).copy()
  k0 = k.copy()
  order = [int(i) for i in order]
  first = len(order) if first is None else max(1, min(int(first), len(order)))
  active, rest, left = order[:first], order[first:], int(budget)
  while left > 0:
    progressed = False
    for i in active:
      if left == 0:
        break
      if k[i] < cap:
        k[i] += 1
        left -= 1
        progressed = True
    if not progressed:
      if not rest:
        break
      active.append(rest.pop(0))
  return k - k0
