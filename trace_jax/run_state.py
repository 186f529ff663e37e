"""What a training run holds: `Run` (built once), `LoopState` (changes every step), `Hooks` (where a
caller wraps the run's parts), and the host-side state a checkpoint carries besides the device
arrays (`host_state`, `load_host_state`). The step functions that build and advance them are in
`trace_jax.train`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.allocation.driver import RolloutDriver
from trace_jax.allocation.predictor_fit import PredictorFitter
from trace_jax.checkpoint import Checkpointer
from trace_jax.config import TrainConfig
from trace_jax.metrics import MetricWriter
from trace_jax.parallel import fetch
from trace_jax.rl.update import UpdateConfig
from trace_jax.sampling.engine import SamplerEngine


@dataclasses.dataclass(frozen=True)
class Hooks:
  """Where a caller may wrap a run's parts (fault injection in tests and the chaos benchmark,
  instrumentation): each is a function from the part the run built to the one it uses, or None.

  retriever: the retriever -> the one the environment searches with.
  env: the environment -> the one the sampler steps.
  batch: (RL step, packed batch dict) -> the batch the update trains on.
  """
  retriever: Callable[[Any], Any] | None = None
  env: Callable[[Any], Any] | None = None
  batch: Callable[[int, dict], dict] | None = None


@dataclasses.dataclass
class Run:
  """What a run builds once. The engine, driver and fitter keep host-side state of their own
  (rng streams, the predictor's replay buffer); `host_state`/`load_host_state` read and set it so
  a checkpoint holds everything that decides the future."""
  c: TrainConfig
  workdir: str
  mesh: Any
  assets: Any
  graphdef: Any
  pred_graphdef: Any
  env: Any                    # the multi-hop environment (its retriever's stats go to the metrics)
  engine: SamplerEngine
  driver: RolloutDriver
  fitter: PredictorFitter
  update: Callable            # jitted (train_state, batch) -> (train_state, metrics)
  predict: Callable           # (pred_params, features f32[N, D]) -> p̂ f32[N]
  writer: MetricWriter
  ckpt: Checkpointer
  ref_params: Any             # frozen reference policy (only when rl.kl_coef > 0)
  shardings: Any              # NamedShardings of the train state on a multi-device mesh, else None
  init_params: Any            # policy after the warm start (RL starts here)
  init_pred_params: Any
  update_cfg: UpdateConfig
  init_param_norm: float      # global norm of the warm-started policy (divergence reference)
  warm_start: dict
  synthetic: bool
  t_start: float
  hooks: Hooks = Hooks()
  # LoRA (model.lora.rank > 0): the frozen base and the adapted graph (`trace_jax.lora_run`);
  # `init_params` and the train state's params are then the adapters. None: full fine-tuning.
  lora: Any = None


@dataclasses.dataclass
class LoopState:
  """Everything that changes during RL. `train` is the device pytree the jitted update takes
  (params, opt, pred_params, pred_opt, step, skipped); the rest is host bookkeeping."""
  train: dict
  step: int = 0                      # RL steps done
  totals: dict = dataclasses.field(default_factory=lambda: dict(
      generated_tokens=0, rollouts=0, prefill_tokens=0, tool_calls=0))
  evals: dict = dataclasses.field(default_factory=dict)   # str(step) -> greedy EM
  predictions: list = dataclasses.field(default_factory=list)  # (stage, p̂, outcome)
  er_hist: list = dataclasses.field(default_factory=list)
  probe: dict | None = None          # the warm-start probe (first run only)
  wall_before: float = 0.0           # wall seconds of the earlier processes, to their checkpoint

  @property
  def skip_streak(self) -> int:
    """Consecutive updates skipped as non-finite (the update's own count,
    `train["skip_streak"]`)."""
    return int(fetch(self.train["skip_streak"]))


def wall_seconds(run: Run, state: LoopState) -> float:
  """The run's wall clock over every process it took, up to now (a stopped process's work after
  its last checkpoint is redone, so it is not counted)."""
  return state.wall_before + time.time() - run.t_start


def host_state(run: Run) -> dict:
  """What the run's host objects carry from one step to the next: the predictor fitter's replay
  buffers and optimizer state, the engine's ledger and the driver's record of p̂ on random pool
  slices (its running metrics). (Rng streams are reseeded from (seed,
  step) at every step.)"""
  return {"fitter_buffer": list(run.fitter.buffer), "fitter_roots": list(run.fitter.roots),
          "fitter_opt": [np.asarray(x) for x in jax.tree.leaves(run.fitter.state_dict())],
          "ledger": run.engine.ledger.as_dict(),
          **run.driver.state_dict()}


def load_host_state(run: Run, d: dict) -> None:
  run.fitter.buffer.clear()
  run.fitter.buffer.extend(tuple(e) for e in d["fitter_buffer"])
  run.fitter.roots.clear()
  run.fitter.roots.extend(tuple(e) for e in d["fitter_roots"])
  tree = jax.tree.structure(run.fitter.state_dict())
  run.fitter.load_state_dict(jax.tree.unflatten(tree, [jnp.asarray(x) for x in d["fitter_opt"]]))
  run.driver.load_state_dict(d)
  for k, v in d["ledger"].items():
    setattr(run.engine.ledger, k, v)
