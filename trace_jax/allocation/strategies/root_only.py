"""root_only: TRACE's stage 1 (p̂ over the pool), then the continuations spread evenly over every
candidate anchor, the remainder to random ones: the ablation that isolates stage 2."""

from __future__ import annotations

import jax
import numpy as np

from trace_jax.allocation.strategies.base import register, uniform_prefixes
from trace_jax.allocation.strategies.predicted import PredictedRoots


@register
class RootOnly(PredictedRoots):
  name = "root_only"

  def spread(self, driver, trees, cands, n_cont):
    key = jax.random.key(int(driver.rng.integers(2**31)))
    return np.asarray(uniform_prefixes(np.ones(len(cands), bool), n_cont, key))
