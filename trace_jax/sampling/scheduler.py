"""Task-affine workers over the sampler's slots, a synchronous-turns baseline, and utilization.

Task affinity: the slots are split into W contiguous blocks (workers); each tree (all rollouts of a
prompt, forks included) belongs to one worker, and a worker's free slots are refilled only from its
own trees. Workers never wait for each other: a slot whose branch finishes is refilled at once, and
the environment runs for whichever slots ended a turn in that step. Sharing one batched decode step
keeps the device busy; on several hosts each process is one worker running its own engine (the
code path is the same with W = 1 per process). Keeping a tree on one worker keeps its shared KV
pages, and every later fork from them, local.

Synchronous turns (the baseline): all branches of a batch take a turn, every slot waits for the
slowest turn of the batch, the environment runs for all of them, and a new batch starts only when
every trajectory of the previous one has finished (or, with refill, free slots take new branches
at each turn barrier).

Utilization is busy slot-steps / total slot-steps over the decode steps of a run. It reads the
engine's per-step log, which an engine keeps only when built with `record_steps` (the most recent
decode steps kept); a run longer than that is refused rather than reported on part of its steps.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from trace_jax.sampling.engine import SamplerEngine
from trace_jax.sampling.tree import Tree


@dataclasses.dataclass
class UtilizationReport:
  """Slot usage of one run.

  utilization: busy slot-steps / (num_slots * decode_steps).
  worker_utilization: the same per worker (over the run's steps, so a worker that runs dry early
    shows the wait it would impose if it had to wait for the others).
  idle_slot_steps: slot-steps with no token generated (waiting at a barrier or without work).
  tail_steps: trailing decode steps in which fewer than half of the slots were busy (the long-tail
    wait for the slowest rollouts); utilization_before_tail: utilization over the steps before.
  worker_done_step: last step in which each worker had a busy slot.
  """

  mode: str
  num_slots: int
  num_workers: int
  decode_steps: int
  busy_slot_steps: int
  utilization: float
  worker_utilization: list[float]
  idle_slot_steps: int
  tail_steps: int
  utilization_before_tail: float
  worker_done_step: list[int]
  generated_tokens: int
  wall_s: float = 0.0

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def utilization_report(engine: SamplerEngine, start_step: int, mode: str, num_workers: int,
                       generated_tokens: int = 0, wall_s: float = 0.0) -> UtilizationReport:
  """Summarizes `engine.step_log[start_step:]` (busy slots per worker, one row per decode step:
  i32[num_workers] each)."""
  s = engine.cfg.num_slots
  log = np.asarray(list(engine.step_log)[start_step:], np.int64).reshape(-1, num_workers)
  steps = log.shape[0]
  busy = log.sum(axis=1)
  per_worker_slots = np.bincount(engine.slot_worker, minlength=num_workers)
  full_enough = np.nonzero(busy >= s / 2)[0]
  tail = int(steps - 1 - full_enough[-1]) if full_enough.size else steps
  done = [int(np.nonzero(log[:, w])[0].max()) if log[:, w].any() else -1
          for w in range(num_workers)]
  total = max(1, steps * s)
  return UtilizationReport(
      mode=mode, num_slots=s, num_workers=num_workers, decode_steps=steps,
      busy_slot_steps=int(busy.sum()), utilization=float(busy.sum() / total),
      worker_utilization=[float(log[:, w].sum() / max(1, steps * per_worker_slots[w]))
                          for w in range(num_workers)],
      idle_slot_steps=int(steps * s - busy.sum()), tail_steps=tail,
      utilization_before_tail=float(busy[:steps - tail].sum() / max(1, (steps - tail) * s)),
      worker_done_step=done,
      generated_tokens=generated_tokens, wall_s=wall_s)


def _run(engine, requests, mode, num_workers, sync_turns, sync_refill=False):
  if not engine.record_steps:
    raise ValueError("utilization needs the engine's step log: build the SamplerEngine with "
                     "record_steps > 0 (the decode steps it keeps)")
  engine.step_log.clear()  # the report covers this run alone
  tokens0, steps0 = engine.ledger.generated_tokens, engine.ledger.decode_steps
  t0 = time.perf_counter()
  trees = engine.run(requests, num_workers=num_workers, sync_turns=sync_turns,
                     sync_refill=sync_refill)
  wall = time.perf_counter() - t0
  steps = engine.ledger.decode_steps - steps0
  if steps > len(engine.step_log):  # the bounded log dropped the run's first steps
    raise RuntimeError(f"the run made {steps} decode steps but the engine keeps the last "
                       f"{engine.record_steps}; build it with a larger record_steps")
  return trees, utilization_report(engine, 0, mode, num_workers,
                                   engine.ledger.generated_tokens - tokens0, wall)


def run_task_affine(engine: SamplerEngine, requests, num_workers: int = 1
                    ) -> tuple[list[Tree], UtilizationReport]:
  """Asynchronous workers, each owning whole trees and its own block of slots."""
  return _run(engine, requests, f"task_affine_w{num_workers}", num_workers, sync_turns=False)


def run_synchronous(engine: SamplerEngine, requests, refill: bool = False
                    ) -> tuple[list[Tree], UtilizationReport]:
  """Synchronous turns: every slot waits for the slowest turn. Without `refill` a new batch of
  branches starts only when the previous one has finished; with it, free slots are refilled at
  each turn barrier (the new branches then move in step with the others)."""
  return _run(engine, requests, "synchronous_refill" if refill else "synchronous", 1,
              sync_turns=True, sync_refill=refill)


__all__ = ["UtilizationReport", "run_synchronous", "run_task_affine", "utilization_report"]
