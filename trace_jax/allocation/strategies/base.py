"""The interface every method implements, its registry, and the rules several methods share.

A strategy answers four questions for one RL step, with the driver (`allocation.driver`) asking
and the sampler doing the work:

  root_plan        which prompts of the step's pool get stage-1 rollouts, and how many
  candidates       which anchors (tree, node) of the finished stage-1 trees stage 2 may fork from
  prefix_counts    how many continuations each anchor gets
  keep             which trees the update trains on (DAPO drops all-equal groups)

plus two facts: `advantage` (the estimator it trains with; None = the run's configured one) and
`prompts_per_step` (how many prompts the loop draws per step). Every method spends the same budget
(`root_budget + prefix_budget` rollouts, or the generated tokens they cost); the engine's ledger
proves it. A method is one module that defines a `Strategy` subclass and registers it:

    @register
    class MyMethod(Strategy):
      name = "my_method"
      ...

`get(name)` returns the class, `names()` every registered name in registration order.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

_REGISTRY: dict[str, type["Strategy"]] = {}


def register(cls: type["Strategy"]) -> type["Strategy"]:
  """Class decorator: makes `cls` selectable by `cls.name` (e.g. `--config.method=NAME`)."""
  if not cls.name:
    raise ValueError(f"{cls.__name__} has no name")
  if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
    raise ValueError(f"a strategy named {cls.name!r} is already registered "
                     f"({_REGISTRY[cls.name].__module__})")
  _REGISTRY[cls.name] = cls
  return cls


def unregister(name: str) -> None:
  """Removes a registered strategy (tests that register a toy one clean up with this)."""
  _REGISTRY.pop(name, None)


def names() -> tuple[str, ...]:
  """Every registered method name, in registration order."""
  return tuple(_REGISTRY)


def get(name: str) -> type["Strategy"]:
  """The strategy class registered as `name`; ValueError listing the choices otherwise."""
  if name not in _REGISTRY:
    raise ValueError(f"unknown strategy {name!r}; choose one of {names()}")
  return _REGISTRY[name]


def advantage_for(name: str, default: str) -> str:
  """The advantage estimator (a key of `trace_jax.rl.batch.ADVANTAGES`) method `name` trains with:
  its own when it has one (the baselines, as their papers define them), else `default`."""
  return get(name).advantage or default


_NO_INDEX = np.zeros(0, np.int64)


@dataclasses.dataclass
class RootPlan:
  """Stage 1's decision over the step's pool of P prompts.

  counts: i32[P] rollouts per prompt (0 = not sampled). p_hat: f32[P] the success estimates the
  allocation used (calibrated when calibration is on), or None when it read no predictor.
  raw_p_hat: the head's own p̂ before calibration (None likewise). calibration: the Platt map
  (a, b) applied. slots: pool indices taken by forced slots ({"explored": ..., "hard": ...}).
  concentration: f32[P] κ of the Beta(κ p̂, κ (1 - p̂)) the root objective read (None for the
  paper's point-estimate objective). beta_mean: f32[P] the Beta's mean where it is not p̂ (the
  `binned` objective's, read off past outcomes), else None.
  """
  counts: np.ndarray
  p_hat: np.ndarray | None = None
  raw_p_hat: np.ndarray | None = None
  calibration: tuple[float, float] = (1.0, 0.0)
  slots: dict = dataclasses.field(
      default_factory=lambda: {"explored": _NO_INDEX, "hard": _NO_INDEX})
  concentration: np.ndarray | None = None
  beta_mean: np.ndarray | None = None


class Strategy:
  """One method. Subclasses set `name` (and `advantage` when the method has its own estimator) and
  override what differs; the defaults are GRPO's: every prompt of the step, the whole budget
  split evenly at the roots, no stage 2, every tree trained on.

  Methods receive the driver (`allocation.driver.RolloutDriver`) for what a step shares: `cfg`
  (DriverConfig), `rng` (the step's numpy Generator, reseeded from (seed, step) by the loop),
  `predict` (features -> p̂) and `prompt_features` (prompt ids -> features), and
  `calibrated(p̂)` (the Platt map fit on the random slice)."""

  name: ClassVar[str] = ""
  advantage: ClassVar[str | None] = None
  reads_predictor: ClassVar[bool] = False  # stage 1 scores prompts with p̂ (a predictor is fit)

  def __init__(self, cfg):
    self.cfg = cfg

  @classmethod
  def has_stage2(cls) -> bool:
    """Whether the method forks continuations from anchors (it overrides `prefix_counts` or
    `spread`)."""
    return (cls.prefix_counts is not Strategy.prefix_counts) or (cls.spread is not Strategy.spread)

  def prompts_per_step(self) -> int:
    """Prompts the loop draws for one step (the pool the root plan chooses from)."""
    return self.cfg.prompts_per_step

  def root_budget(self) -> int:
    """Rollouts stage 1 spends: by default the whole budget (no stage 2)."""
    return self.cfg.root_budget + self.cfg.prefix_budget

  def root_plan(self, driver, examples: list, use_predictor: bool) -> RootPlan:
    c, p = self.cfg, len(examples)
    if p > c.prompts_per_step > 0:
      raise ValueError(f"{self.name} samples every prompt it is given: pass prompts_per_step "
                       f"({c.prompts_per_step}) prompts, not {p}")
    return RootPlan(np.asarray(uniform_roots(p, self.root_budget())))

  def candidates(self, trees) -> list[tuple[int, int]]:
    """Stage-2 anchors (tree index, node id): the internal turn boundaries of the stage-1 chains
    (a node that is neither the root nor a leaf and has a child)."""
    return [(ti, n.id) for ti, t in enumerate(trees) for n in t.nodes
            if n.parent >= 0 and not n.done and n.children]

  def prefix_counts(self, driver, trees, cands, use_predictor: bool):
    """i32[H] continuations per candidate, and f32[H] the success estimates the allocation read
    (None when it read none). The default: a rule that reads no estimate (`spread`) hands out the
    continuations the stage-2 budget buys (`PrefixBudget.continuations`); none without a rule."""
    zeros = np.zeros(len(cands), np.int32)
    if not cands or self.cfg.prefix_budget <= 0 or not self.has_stage2():
      return zeros, None
    n_cont = prefix_budget(self.cfg, trees, cands).continuations
    return self.spread(driver, trees, cands, n_cont), None

  def value_curve(self, driver, trees, cands, use_predictor: bool, max_units: int):
    """f32[max_units + 1]: the method's stage-2 objective when it spends b = 0..max_units
    rollouts on these trees, or None for a rule with no objective (the default). A streamed stage
    2 reads its increments as the marginal value of each further continuation."""
    return None

  def spread(self, driver, trees, cands, n_cont: int) -> np.ndarray:
    """A baseline's stage-2 rule: `n_cont` continuations over the candidates, i32[H]."""
    raise NotImplementedError

  def keep(self, trees) -> tuple[list, dict[str, Any]]:
    """The trees to train on, and what the choice adds to the step's record."""
    return trees, {}


# ---- shared rules --------------------------------------------------------------------------------
def uniform_roots(num_prompts: int, budget: int):
  """GRPO's stage 1: the budget split evenly, the remainder to the first prompts. i32[P]."""
  if num_prompts <= 0:
    raise ValueError(f"num_prompts must be positive, got {num_prompts}")
  base, rem = divmod(int(budget), int(num_prompts))
  return base + (jnp.arange(num_prompts) < rem).astype(jnp.int32)


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


@dataclasses.dataclass(frozen=True)
class PrefixBudget:
  """What stage 2 may spend. costs: f32[H] expected generated tokens of one continuation from each
  candidate; tokens: whether the budget is counted in tokens; token_budget: the generated tokens
  `prefix_budget` fresh rollouts cost (this step's mean whole-rollout length x prefix_budget);
  continuations: how many continuations the baselines' rules get (prefix_budget, or under tokens
  as many as token_budget buys at the candidates' mean cost)."""
  costs: np.ndarray
  tokens: bool
  token_budget: float
  continuations: int


def prefix_budget(cfg, trees, cands) -> PrefixBudget:
  """The step's stage-2 budget (see `PrefixBudget`); budget_unit="tokens" makes a method whose
  continuations start deep, hence are short, get more of them, so the step spends about the
  generated tokens of uniform GRPO with root_budget + prefix_budget rollouts."""
  cost_by_depth = remaining_cost(trees)
  costs = np.asarray([cost_by_depth.get(trees[ti].nodes[nid].depth, 1.0) for ti, nid in cands],
                     np.float32)
  tokens = cfg.budget_unit == "tokens"
  token_budget = float(cfg.prefix_budget * cost_by_depth.get(0, float(np.mean(costs))))
  n_cont = cfg.prefix_budget
  if tokens:
    n_cont = max(1, int(round(token_budget / float(np.mean(costs)))))
  return PrefixBudget(costs, tokens, token_budget, n_cont)


def remaining_cost(trees) -> dict[int, float]:
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


def round_robin(order, size: int, budget: int, cap: int, first: int | None = None,
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
