"""root_only: TRACE's stage 1 (p̂ over the pool), then the continuations spread evenly over every
candidate anchor, the remainder to random ones: the ablation that isolates stage 2."""

from __future__ import annotations

import jax
import numpy as np

from trace_jax.allocation.strategies.base import prefix_budget, register, uniform_prefixes
from trace_jax.allocation.strategies.predicted import PredictedRoots


@register
class RootOnly(PredictedRoots):
  name = "root_only"

  def prefix_counts(self, driver, trees, cands, use_predictor):
    if not cands or self.cfg.prefix_budget <= 0:
      return np.zeros(len(cands), np.int32), None
    n_cont = prefix_budget(self.cfg, trees, cands).continuations
    key = jax.random.key(int(driver.rng.integers(2**31)))
    return np.asarray(uniform_prefixes(np.ones(len(cands), bool), n_cont, key)), None
