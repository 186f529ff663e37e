"""Comparing two runs' metric records when they may differ by float rounding only.

A run whose sampler preempts branches (a KV pool below the need, `sampling.engine_preempt`)
recomputes their K/V with a prefill rather than the decode step that first wrote it: the same
tokens are sampled, but later log-probs, and the losses and parameters read from them, may differ
in the last bits. `compare_records` tells those apart from real differences (a reward, a count, a
token), and `array_difference` measures parameters the same way.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np


def compare_records(a: Sequence[dict], b: Sequence[dict], ignored: Callable[[str], bool] = None,
                    rel: float = 1e-5, floor: float = 1e-9) -> dict:
  """Field by field over records in order: `equal`, equal to `rounding` (floats within `rel`
  relative difference, or both below `floor` in magnitude: noise around zero) or `different`
  (a list of {step, key, a, b}; a record count that differs is one too). `max_relative`: the
  largest relative difference among rounding fields above the floor. `ignored(key)` skips
  fields (e.g. timings)."""
  out = {"records": [len(a), len(b)], "equal": 0, "rounding": 0, "different": [],
         "max_relative": 0.0}
  for ra, rb in zip(a, b):
    for key in sorted(set(ra) | set(rb)):
      if ignored is not None and ignored(key):
        continue
      va, vb = ra.get(key), rb.get(key)
      if va == vb or all(isinstance(v, float) and math.isnan(v) for v in (va, vb)):
        out["equal"] += 1
        continue
      floats = all(isinstance(v, float) for v in (va, vb))
      big = max(abs(va), abs(vb)) if floats else 0.0
      if floats and (big < floor or abs(va - vb) <= rel * big):
        out["rounding"] += 1
        if big >= floor:
          out["max_relative"] = max(out["max_relative"], abs(va - vb) / big)
        continue
      out["different"].append({"step": ra.get("step", rb.get("step")), "key": key, "a": va,
                               "b": vb})
  if len(a) != len(b):
    out["different"].append({"key": "records", "a": len(a), "b": len(b)})
  return out


def array_difference(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
  """The largest, over pairs of arrays, of max |x - y| / max |y|: 0.0 when every pair is equal,
  inf when the lists or shapes differ."""
  if len(a) != len(b):
    return math.inf
  worst = 0.0
  for x, y in zip(a, b):
    if x.shape != y.shape:
      return math.inf
    if not np.array_equal(x, y):
      x64, y64 = np.asarray(x, np.float64), np.asarray(y, np.float64)
      worst = max(worst, float(np.abs(x64 - y64).max() / max(np.abs(y64).max(), 1e-30)))
  return worst


__all__ = ["array_difference", "compare_records"]
