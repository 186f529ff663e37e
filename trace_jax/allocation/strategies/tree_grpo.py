"""Tree-GRPO: GRPO's roots with `root_budget`, then every tree expands uniformly random nodes of its
own; trains with the Tree-GRPO advantage (GRPO by prompt + GRPO within each first rollout's
subtree)."""

from __future__ import annotations

import numpy as np

from trace_jax.allocation.strategies.base import Strategy, register, round_robin


@register
class TreeGrpo(Strategy):
  name = "tree_grpo"
  advantage = "tree_grpo"

  def root_budget(self) -> int:
    return self.cfg.root_budget

  def spread(self, driver, trees, cands, n_cont):
    return tree_grpo_counts(driver.rng, cands, n_cont, self.cfg.max_per_anchor)


def tree_grpo_counts(rng, cands, n_cont: int, cap: int) -> np.ndarray:
  """Tree-GRPO's expansion: the continuations are split evenly over the trees that have
  candidates (the remainder to random ones); within a tree each goes to a uniformly random anchor,
  distinct anchors first, at most `cap` each while room remains; trees whose anchors are all at
  the cap pass their share on. cands: [(tree index, node id)]; returns i32[H]."""
  by_tree: dict[int, list[int]] = {}
  for j, (ti, _) in enumerate(cands):
    by_tree.setdefault(ti, []).append(j)
  tids = list(by_tree)
  share = np.full(len(tids), n_cont // len(tids), np.int64)
  share[rng.permutation(len(tids))[:n_cont % len(tids)]] += 1
  k = np.zeros(len(cands), np.int32)
  left = 0
  for ti, n in zip(tids, share):
    js = np.asarray(by_tree[ti])
    kt = round_robin(js[rng.permutation(len(js))], len(cands), int(n), cap)
    k += kt
    left += int(n) - int(kt.sum())
  if left:
    k += round_robin(rng.permutation(len(cands)), len(cands), left, cap, start=k)
  return k
