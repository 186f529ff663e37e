"""What the embedded tool tasks' generated worlds share: a list of problems per split, the
expert's rate per template, a file format, and how the rates are drawn."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar

import numpy as np

from trace_jax.fileio import CorruptFileError, atomic_write_json, read_json


def stratified_rates(rng: np.random.Generator, k: int, lo: float, hi: float,
                     spacing: str = "linear") -> np.ndarray:
  """k rates evenly spaced over [lo, hi] (cell midpoints; `spacing="log"`: evenly over the
  logarithm, lo > 0) in a random order: every world gets the same spread of difficulty, and only
  its pairing with templates (or relations) is drawn."""
  if not 0.0 <= lo <= hi <= 1.0:
    raise ValueError(f"expert_rate_range must satisfy 0 <= lo <= hi <= 1, got {(lo, hi)}")
  cells = (rng.permutation(k) + 0.5) / k
  if spacing == "linear":
    return lo + (hi - lo) * cells
  if spacing == "log":
    if lo <= 0:
      raise ValueError(f"log-spaced expert rates need lo > 0, got {lo}")
    return np.exp(np.log(lo) + (np.log(hi) - np.log(lo)) * cells)
  raise ValueError(f"spacing must be 'linear' or 'log', got {spacing!r}")


@dataclasses.dataclass
class ProblemWorld:
  """config: the generator's config; train, test: problems (dataclasses); expert_rates: template
  -> the expert's rate of the correct method. Subclasses name their file, problem and config
  classes."""

  config: Any
  train: list
  test: list
  expert_rates: dict

  FILE: ClassVar[str] = "world.json"
  PROBLEM: ClassVar[type] = dict
  CONFIG: ClassVar[type] = dict

  def save(self, directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    atomic_write_json(os.path.join(directory, self.FILE),
                      dict(config=dataclasses.asdict(self.config), expert_rates=self.expert_rates,
                           train=[dataclasses.asdict(p) for p in self.train],
                           test=[dataclasses.asdict(p) for p in self.test]))

  @classmethod
  def load(cls, directory: str):
    path = os.path.join(directory, cls.FILE)
    if not os.path.exists(path):
      raise FileNotFoundError(f"{path} not found: not a directory written by {cls.__name__}.save")
    p = read_json(path)
    if not isinstance(p, dict) or not {"config", "train", "test", "expert_rates"} <= set(p):
      raise CorruptFileError(f"{path}: not a complete {cls.__name__} (delete it to rebuild)")
    cfg = {k: tuple(v) if isinstance(v, list) else v for k, v in p["config"].items()}
    return cls(cls.CONFIG(**cfg), [cls.PROBLEM(**x) for x in p["train"]],
               [cls.PROBLEM(**x) for x in p["test"]], p["expert_rates"])


__all__ = ["ProblemWorld", "stratified_rates"]
