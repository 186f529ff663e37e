"""How many KV pages an RL step may hold against its pool: the worst case of a config.

Finished trees keep their pages cached until the step ends (stage 2 forks from them), so the pages
a data shard would hold at a step's end are every rollout of its trees: stage 1's roots, stage 2's
continuations and the measured slice (rollouts one step ahead add the next step's stage 1). In the
worst case every rollout runs to `env.max_seq_len` and no prefix is shared. A pool below that
worst case never cuts a rollout: it evicts cached K/V (a later fork recomputes its prefix), and
when the rollouts decoding at once outgrow it (the working set: every slot of a shard at
`max_seq_len`), it preempts branches and recomputes their K/V when they resume
(`sampling.engine_preempt`). Only a shard that cannot hold one rollout alone is refused.
"""

from __future__ import annotations

import dataclasses
import math

from trace_jax.config import TrainConfig
from trace_jax.parallel.sharding import parse_mesh_spec
from trace_jax.sampling.paged_kv import tree_pages


@dataclasses.dataclass(frozen=True)
class PageDemand:
  """Worst-case KV pages of one data shard in one RL step, against the pages it holds."""
  shards: int            # data x fsdp: trees are spread over them whole
  rollouts: int          # rollouts of a step on the busiest shard
  pages_per_rollout: int  # ceil(max_seq_len / page_size)
  need: int              # worst-case pages on the busiest shard, every tree cached to the end
  have: int              # pages of one pool shard (less its null page)
  working_set: int       # every decode slot of a shard at max_seq_len at once

  @property
  def ratio(self) -> float:
    return self.need / max(self.have, 1)

  def verdict(self) -> str:
    if self.pages_per_rollout + 1 > self.have:
      return "refused: one rollout alone does not fit a shard"
    if self.ratio <= 1:
      return "fits the worst case: nothing is ever evicted or preempted"
    if self.working_set <= self.have:
      return (f"evicts cached K/V when more than {1 / self.ratio:.0%} of the worst case is live "
              f"(forks then recompute prefixes); never preempts")
    return (f"preempts often when rollouts run long: the slots' working set is "
            f"{self.working_set / self.have:.1f}x the pool")


def step_rollouts(c: TrainConfig) -> int:
  """Rollouts one RL step samples and keeps until it ends: the root and prefix budgets, the
  measured slice, and with rollouts one step ahead the next step's roots (dapo oversamples)."""
  r = c.rollout
  n = r.root_budget + r.prefix_budget + r.metric_slice * r.metric_rollouts
  if c.method == "dapo":
    n = math.ceil(r.root_budget * r.dapo_oversample) + r.prefix_budget
  return n + (r.root_budget if r.off_policy_steps else 0)


def page_demand(c: TrainConfig, devices: int) -> PageDemand:
  """The worst case of config `c` on `devices` devices of its mesh (`c.mesh`, -1 axes filled)."""
  sizes = parse_mesh_spec(c.mesh)
  fixed = math.prod(v for v in sizes.values() if v > 0)
  sizes = {k: (devices // fixed if v < 0 else v) for k, v in sizes.items()}
  shards = max(sizes.get("data", 1) * sizes.get("fsdp", 1), 1)
  rollouts = -(-step_rollouts(c) // shards)
  need, have = tree_pages(rollouts, c.env.max_seq_len, c.rollout.page_size, c.rollout.num_pages,
                          shards)
  per_rollout = -(-c.env.max_seq_len // c.rollout.page_size)
  return PageDemand(shards=shards, rollouts=rollouts, pages_per_rollout=per_rollout, need=need,
                    have=have, working_set=-(-c.rollout.num_slots // shards) * per_rollout)


def format_demand(rows: list[tuple[str, int, PageDemand]]) -> str:
  """A markdown table of (variant, devices, demand) rows."""
  out = ["| variant | devices | data x fsdp | rollouts / shard | pages / rollout | worst case "
         "pages / shard | pool pages / shard | need / pool | what happens |",
         "|---|---|---|---|---|---|---|---|---|"]
  for name, devices, d in rows:
    out.append(f"| {name} | {devices} | {d.shards} | {d.rollouts} | {d.pages_per_rollout} | "
               f"{d.need} | {d.have} | {d.ratio:.2f} | {d.verdict()} |")
  return "\n".join(out)


__all__ = ["PageDemand", "format_demand", "page_demand", "step_rollouts"]
