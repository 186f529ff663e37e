"""DAPO's dynamic sampling at equal budget: oversample prompts, split the whole budget over them in
nearly equal groups, train only on groups whose rewards differ, and count what was dropped."""

from __future__ import annotations

import numpy as np

from trace_jax.allocation.strategies.base import RootPlan, Strategy, register


@register
class Dapo(Strategy):
  """Draws `round(prompts_per_step x dapo_oversample)` prompts; the budget goes to the first
  `min(P, budget // 2)` of them (groups of at least 2, sizes differing by at most 1); groups whose
  rewards are all equal are dropped after sampling (their cost stays in the ledger, which is what
  makes the comparison at equal budget honest). Trains with GRPO's advantage; no stage 2."""
  name = "dapo"
  advantage = "grpo"

  def prompts_per_step(self) -> int:
    return dapo_prompts(self.cfg.prompts_per_step, self.cfg.dapo_oversample)

  def root_plan(self, driver, examples, use_predictor) -> RootPlan:
    total = self.root_budget()
    n_prompts = min(len(examples), total // 2)
    base, rem = divmod(total, n_prompts)
    counts = np.zeros(len(examples), np.int32)
    counts[:n_prompts] = [base + (i < rem) for i in range(n_prompts)]
    return RootPlan(counts)

  def candidates(self, trees):
    return []  # no stage 2

  def keep(self, trees):
    kept = [t for t in trees if t.mixed]
    return kept, dict(dapo_dropped_groups=len(trees) - len(kept),
                      dapo_dropped_rollouts=sum(len(t.leaves()) for t in trees if not t.mixed))


def dapo_prompts(prompts_per_step: int, oversample: float) -> int:
  """How many prompts DAPO samples per step to keep about `prompts_per_step` mixed groups."""
  return max(prompts_per_step, int(round(prompts_per_step * oversample)))
