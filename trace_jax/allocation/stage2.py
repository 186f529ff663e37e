"""Stage 2's decisions for one RL step, batch or streamed, and the stage-1 view of a tree they
keep (`RolloutDriver` makes one `Stage2Decisions` per step).

Batch: one decision over every stage-1 tree with the whole prefix budget. Streamed
(`DriverConfig.stage2="stream"`): the engine's `on_trees_done` callback decides for each group of
stage-1 trees as it finishes, so continuations start in the slots stage 1's tail leaves idle.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from trace_jax.sampling.engine import ForkRequest
from trace_jax.sampling.tree import Tree


@dataclasses.dataclass
class Stage1View:
  """A tree as stage 1 left it (its leaves then, and whether they were mixed): what the step's
  record and the root predictions read once stage 2 has grown the tree."""
  mixed: bool
  leaf_nodes: list

  @classmethod
  def of(cls, tree: Tree) -> "Stage1View":
    return cls(bool(tree.mixed), list(tree.leaves()))

  def leaves(self):
    return self.leaf_nodes


class Stage2Decisions:
  """Stage 2's decisions for one step, batch or streamed.

  Batch: one `decide` over every stage-1 tree with the whole budget. Streamed: `on_done` (the
  engine's `on_trees_done`) decides for each group of stage-1 trees as it finishes. The group gets
  as many continuations as are worth the price (the marginal value of the batch allocator's last
  unit, median over the last steps: `RolloutDriver.stage2_price`), read off the method's value
  curve on the group's trees (`Strategy.value_curve`); without a price yet (the first step) or an
  objective (rule-based methods), the budget left times the group's share of the trees still
  undecided. The last group gets everything left, so the continuations never exceed
  `prefix_budget` and the budget is spent, and when every tree finishes at once the single
  decision is exactly the batch one. With a deadline (`DriverConfig.stage2_deadline` > 0) the
  "last" group is the one after which at most that share of the trees still runs: it spends what
  is left, so its continuations overlap stage 1's tail instead of starting after it, and the
  trees finishing later get none (their candidates are recorded with zero continuations). The
  strategy decides within the group (`prefix_counts` on its trees, with the group's budget), so
  its own rule and estimates apply unchanged.
  `benchmarks/stream_allocation.py` measures the value kept against the batch decision.
  """

  max_share = 2.0  # a priced group takes at most this many fair shares (see `on_done`)

  def __init__(self, driver=None, use_predictor: bool = True, num_trees: int = 0):
    self.driver, self.use_predictor, self.num_trees = driver, use_predictor, num_trees
    self.left = driver.cfg.prefix_budget if driver is not None else 0
    self.decided = 0
    self.index: dict[int, int] = {}   # tree uid -> its index among the stage-1 requests
    self.views: dict[int, Stage1View] = {}
    self.cands, self.conts, self.p_anchor = [], [], []
    self.read_estimates = False
    self.children_before: dict[tuple[int, int], set] = {}
    self.forks: list[ForkRequest] = []
    self.shares: list[int] = []
    self.gains: list[np.ndarray] = []  # each group's marginal gains (its value curve's steps)
    self.tail: list = []  # requests to start with the last decision (the random slice)
    self.slice_trees, self.slice_p = [], []
    self.closed = False  # the last decision is made (every later group gets nothing)

  def decide(self, driver, trees, indices, use_predictor: bool, budget: int,
             cands=None) -> list:
    """Continuations for `trees` (stage-1 tree indices `indices`) within `budget` rollouts:
    records the candidates, counts and estimates, sets each anchor's p̂ and returns the forks."""
    strategy = driver.strategy
    if budget != driver.cfg.prefix_budget:
      strategy = type(strategy)(dataclasses.replace(driver.cfg, prefix_budget=int(budget)))
    if cands is None:  # (the budget never changes which anchors are candidates)
      cands = strategy.candidates(trees)
    conts, p_anchor = strategy.prefix_counts(driver, trees, cands, use_predictor)
    conts = np.asarray(conts, np.int32)
    forks = []
    for j, ((ti, nid), k) in enumerate(zip(cands, conts)):
      if p_anchor is not None and nid != 0:  # the root keeps its stage-1 p̂
        trees[ti].nodes[nid].p_hat = float(p_anchor[j])
      gi = indices[ti]
      if k > 0:
        self.children_before[(gi, nid)] = set(trees[ti].nodes[nid].children)
        forks.append(ForkRequest(trees[ti], nid, int(k)))
      self.cands.append((gi, nid))
      self.conts.append(int(k))
      self.p_anchor.append(float(p_anchor[j]) if p_anchor is not None else float("nan"))
    self.read_estimates = self.read_estimates or p_anchor is not None
    self.shares.append(int(budget))
    self.forks += forks
    return forks

  def on_done(self, idle_trees) -> list:
    """The engine's callback: decides for the stage-1 trees among `idle_trees` (others, slice
    trees and trees whose continuations just finished, need nothing) and returns their forks."""
    new = [t for t in idle_trees if t.uid not in self.views and not t.meta.get("metric_slice")]
    if not new:
      return []
    for t in new:
      self.index[t.uid] = int(t.meta["stage1_index"])  # the tree's place among the requests
      self.views[t.uid] = Stage1View.of(t)
    new.sort(key=lambda t: self.index[t.uid])
    undecided = self.num_trees - self.decided
    self.decided += len(new)
    d = self.driver
    cands = d.strategy.candidates(new)
    curve = d.strategy.value_curve(d, new, cands, self.use_predictor, d.cfg.prefix_budget)
    if curve is not None:  # every group's curve, so the step's batch price covers every tree
      self.gains.append(np.diff(curve))
    if self.closed:  # past the deadline: recorded, nothing granted
      self.decide(d, new, [self.index[t.uid] for t in new], self.use_predictor, 0, cands)
      return []
    price = d.stage2_price()
    running = self.num_trees - self.decided
    last = running == 0 or running <= d.cfg.stage2_deadline * self.num_trees
    if last:  # the last group (or the deadline's): everything left
      share = self.left
    elif curve is None or price is None:  # no objective, or no price yet: a fair share
      share = self.left * len(new) // undecided
    else:  # the units worth at least what the batch allocator's last unit was worth lately,
      below = np.flatnonzero(np.diff(curve) < price)  # at most `max_share` fair shares
      fair = self.left * len(new) / undecided
      share = min(self.left, int(below[0]) if below.size else len(curve) - 1,
                  int(np.ceil(self.max_share * fair)))
    forks = self.decide(d, new, [self.index[t.uid] for t in new], self.use_predictor, share,
                        cands)
    self.left -= sum(f.k for f in forks)
    self.closed = last
    if last and self.tail:
      forks, self.tail = forks + self.tail, []
    return forks

  def price(self, budget: int) -> float | None:
    """This step's batch price: the marginal value of the batch allocator's last unit, i.e. the
    budget-th largest marginal gain over every group's curve (the groups hold disjoint trees and
    the objectives add over trees, so the batch greedy's picks are the top ones of the union).
    0 when fewer units than the budget had any value; None without curves."""
    if not self.gains:
      return None
    g = np.sort(np.concatenate(self.gains))[::-1]
    return float(g[budget - 1]) if len(g) >= budget and budget > 0 else 0.0
