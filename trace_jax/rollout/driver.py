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

from trace_jax.rollout import allocation, strategies
from trace_jax.rollout.sampler import ForkRequest, PromptRequest, SamplerEngine
from trace_jax.rollout.tree import Tree


@dataclasses.dataclass(frozen=True)
class DriverConfig:
  method: str = "trace_tree"
  root_budget: int = 96
  prefix_budget: int = 32
  min_per_prompt: int = 2
  max_per_prompt: int = 12
  prompts_per_step: int = 0   # predicted roots: prompts given rollouts out of a larger pool (0 = all)
  max_per_anchor: int = 4
  budget_unit: str = "rollouts"
  tree_lambda: float = 0.1
  blend_prior: float = 0.0
  dapo_oversample: float = 1.5
  arpo_entropy_top: float = 0.25


@dataclasses.dataclass
class StepSample:
  trees: list            # trees to train on
  all_trees: list        # every tree sampled (dapo: dropped groups too)
  predictions: list      # (stage, p_hat, outcome) for every rollout allocated by prediction
  info: dict


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

  # ---- stage 1 -----------------------------------------------------------------------------------
  def _root_counts(self, examples, use_predictor):
    c, p = self.cfg, len(examples)
    kind = strategies.ROOT_ALLOCATION[c.method]
    if kind == "predicted":
      n_sel = c.prompts_per_step if 0 < c.prompts_per_step < p else p
      cap = max(c.max_per_prompt, -(-c.root_budget // n_sel))
      if not use_predictor:  # uniform over the first n_sel prompts of the pool
        m = np.zeros(p, np.int32)
        m[:n_sel] = np.asarray(_alloc_roots(c.root_budget, c.min_per_prompt, cap)(
            np.full(n_sel, 0.5, np.float32)))
        return m, None
      p_hat = np.clip(self.predict(self.prompt_features([e["prompt_ids"] for e in examples])),
                      1e-4, 1 - 1e-4).astype(np.float32)
      if n_sel < p:  # choose the prompts as well as their counts
        m = _alloc_roots_subset(c.root_budget, n_sel, c.min_per_prompt, cap)(p_hat)
      else:
        m = _alloc_roots(c.root_budget, c.min_per_prompt, cap)(p_hat)
      return np.asarray(m), p_hat
    if len(examples) > c.prompts_per_step > 0 and c.method != "dapo":
      raise ValueError(f"{c.method} samples every prompt it is given: pass prompts_per_step "
                       f"({c.prompts_per_step}) prompts, not {len(examples)}")
    budget = c.root_budget if kind == "uniform" and c.method != "grpo" else \
        c.root_budget + c.prefix_budget
    return np.asarray(strategies.uniform_roots(p, budget)), None

  # ---- stage 2 -----------------------------------------------------------------------------------
  def _candidates(self, trees):
    """Internal turn boundaries of the stage-1 chains: (tree index, node id) with features."""
    cands = []
    for ti, t in enumerate(trees):
      for n in t.nodes:
        if n.parent >= 0 and not n.done and n.children:
          cands.append((ti, n.id))
    return cands

  def _remaining_cost(self, trees) -> dict[int, float]:
    """Expected generated tokens of a continuation from depth d, from this step's stage 1."""
    per_depth: dict[int, list[float]] = {}
    for t in trees:
      for leaf in t.leaves():
        path = t.path(leaf.id)
        gen = [len(t.nodes[i].gen_ids) for i in path]
        for d in range(1, len(path)):
          per_depth.setdefault(d, []).append(float(sum(gen[d + 1:])))
    return {d: max(np.mean(v), 1.0) for d, v in per_depth.items()}

  def _prefix_counts(self, trees, cands, use_predictor):
    c = self.cfg
    kind = strategies.PREFIX_ALLOCATION[c.method]
    h = len(cands)
    if kind == "none" or h == 0 or c.prefix_budget <= 0:
      return np.zeros(h, np.int32), None
    valid = np.ones(h, bool)
    if kind == "uniform":
      key = jax.random.key(int(self.rng.integers(2**31)))
      return np.asarray(strategies.uniform_prefixes(valid, c.prefix_budget, key)), None
    if kind == "random":
      # Each continuation goes to a uniformly random anchor (distinct anchors first), so the whole
      # budget is spent even with fewer candidates than continuations.
      key = jax.random.key(int(self.rng.integers(2**31)))
      k = np.asarray(strategies.random_anchors(key, valid, min(c.prefix_budget, h),
                                               branches_per_anchor=1))
      extra = c.prefix_budget - int(k.sum())
      if extra > 0:
        np.add.at(k, self.rng.integers(h, size=extra), 1)
      return k, None
    if kind == "entropy":
      ent = np.asarray([trees[ti].nodes[trees[ti].nodes[nid].children[0]].entropies[0]
                        if trees[ti].nodes[trees[ti].nodes[nid].children[0]].entropies else 0.0
                        for ti, nid in cands], np.float32)
      n_anchor = max(1, int(round(c.arpo_entropy_top * h)))
      per = max(1, c.prefix_budget // n_anchor)
      k = np.asarray(strategies.entropy_anchors(ent, valid, top_n=n_anchor,
                                                branches_per_anchor=per)).copy()
      # The remainder goes one each to the highest-entropy chosen anchors.
      chosen = [i for i in np.argsort(-ent, kind="stable") if k[i] > 0]
      for j in range(c.prefix_budget - int(k.sum())):
        k[chosen[j % len(chosen)]] += 1
      return _trim_to_budget(k, c.prefix_budget), None
    outcomes = np.asarray([_outcome(trees[ti], nid) for ti, nid in cands], np.float32)
    if use_predictor:
      feats = np.stack([trees[ti].nodes[nid].feature for ti, nid in cands])
      p_hat = np.asarray(self.predict(feats), np.float32)
    else:
      p_hat = np.full(h, 0.5, np.float32)
    if c.blend_prior > 0:
      p_hat = np.asarray(allocation.blend_with_outcomes(p_hat, outcomes, np.ones(h),
                                                        c.blend_prior))
    p_hat = np.clip(p_hat, 1e-4, 1 - 1e-4)
    cost_by_depth = self._remaining_cost(trees)
    costs = np.asarray([cost_by_depth.get(trees[ti].nodes[nid].depth, 1.0) for ti, nid in cands],
                       np.float32)
    budget = c.prefix_budget
    if c.budget_unit == "tokens":  # the same number of rollouts, priced at their expected tokens
      budget = float(c.prefix_budget * np.mean(costs))
    # Pad candidates (and trees) to buckets so the jitted allocators compile once per bucket.
    hp = -(-h // 64) * 64
    padf = lambda x, v: np.concatenate([x, np.full(hp - h, v, x.dtype)])  # noqa: E731
    args = (padf(p_hat, 0.5), padf(outcomes, 0.0), padf(costs, 1.0))
    if kind == "predicted":
      k = _alloc_prefixes(c.max_per_anchor, c.budget_unit)(*args, budget, padf(valid, False))
    else:
      tree_ids = np.asarray([ti for ti, _ in cands], np.int32)
      tp = -(-len(trees) // 16) * 16
      mixed = np.zeros(tp, bool)
      mixed[:len(trees)] = [t.mixed for t in trees]
      k = _alloc_tree_aware(c.max_per_anchor, c.budget_unit, c.tree_lambda)(
          *args, padf(tree_ids, 0), mixed, budget, padf(valid, False))
    return np.asarray(k)[:h], p_hat

  # ---- one step ----------------------------------------------------------------------------------
  def sample(self, examples: list[dict], use_predictor: bool = True) -> StepSample:
    c = self.cfg
    ledger0 = dict(self.engine.ledger.as_dict())
    if c.method == "dapo":
      return self._sample_dapo(examples, ledger0)
    m, p_root = self._root_counts(examples, use_predictor)
    reqs = [PromptRequest(e["prompt_ids"], int(k), meta=e) for e, k in zip(examples, m) if k > 0]
    trees = self.engine.run(reqs)
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
    cands = self._candidates(trees)
    k, p_pref = self._prefix_counts(trees, cands, use_predictor)
    forks = []
    before = {}
    unmixed = [not t.mixed for t in trees]  # stage-1 state, once per tree
    extra["continuations_unmixed_trees"] = int(sum(kk for (ti, _), kk in zip(cands, k)
                                                   if unmixed[ti]))
    for j, ((ti, nid), kk) in enumerate(zip(cands, k)):
      if p_pref is not None:
        trees[ti].nodes[nid].p_hat = float(p_pref[j])
      if kk > 0:
        before[(ti, nid)] = set(trees[ti].nodes[nid].children)
        forks.append(ForkRequest(trees[ti], nid, int(kk)))
    if forks:
      self.engine.run(forks)
    if p_pref is not None and use_predictor:
      for j, (ti, nid) in enumerate(cands):
        if (ti, nid) in before:
          t = trees[ti]
          for ch in set(t.nodes[nid].children) - before[(ti, nid)]:
            predictions += [("prefix", float(p_pref[j]), float(l.reward or 0.0))
                            for l in _leaves_under(t, ch)]
    for t in trees:
      t.backup()
    ledger = {k2: v - ledger0.get(k2, 0) for k2, v in self.engine.ledger.as_dict().items()}
    info = dict(stage1_mixed=stage1_mixed, stage1_leaves=stage1_leaves, candidates=len(cands),
                anchors_used=int((k > 0).sum()), continuations=int(k.sum()),
                root_counts_std=float(np.std(m[m > 0])) if (m > 0).any() else 0.0,
                prompts_sampled=int((m > 0).sum()), prompts_scored=len(examples), **extra,
                **{f"ledger_{a}": b for a, b in ledger.items()})
    return StepSample(trees=trees, all_trees=trees, predictions=predictions, info=info)

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
def _alloc_prefixes(max_per_anchor, budget_unit):
  return jax.jit(lambda p, o, c, b, v: allocation.allocate_prefixes(
      p, o, c, b, v, max_per_anchor, budget_unit=budget_unit))


@functools.lru_cache(maxsize=None)
def _alloc_tree_aware(max_per_anchor, budget_unit, lam):
  return jax.jit(lambda p, o, c, t, m, b, v: allocation.allocate_prefixes_tree_aware(
      p, o, c, t, m, b, v, max_per_anchor, lam, budget_unit=budget_unit))


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


def _trim_to_budget(k: np.ndarray, budget: int) -> np.ndarray:
  k = np.asarray(k).copy()
  while k.sum() > budget:
    k[np.argmax(k)] -= 1
  return k
