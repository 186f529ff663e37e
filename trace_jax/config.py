"""The typed configuration of a training run: frozen dataclasses, one per section.

The library reads only these. A user's config file (`configs/mhqa.py`, an ml_collections
ConfigDict with a comment on every field) is translated into a `TrainConfig` by
`configs/convert.py`, which checks every value's type and range before anything is built; the
meaning of each field is documented there, beside its default. Build one in Python with
`TrainConfig.from_dict(d)` (a nested dict with every field) or through `configs/convert.py`.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class ModelSection:
  preset: str
  path: str
  tokenizer_path: str
  dtype: str
  param_dtype: str
  hidden_size: int
  num_layers: int
  intermediate_size: int
  predictor_hidden: int
  predictor_features: str


SFT_TRACES = ("expert", "oracle")  # the warm start imitates the imperfect expert, or the oracle
WORLD_KINDS = ("traps", "lessons")  # envs.synthetic_world (two trap relations), envs.lessons_world
# Multi-hop QA with search (synthetic world or real data); the embedded tool tasks
# (envs.tool_tasks): tool-use math, function calling.
TASKS = ("mhqa", "math", "fc")


@dataclasses.dataclass(frozen=True)
class WorldSection:
  seed: int
  cache_dir: str
  trap_rate: float
  kind: str = "traps"  # WORLD_KINDS
  # The lessons world (`envs.lessons_world.LessonsWorldConfig`).
  n_relations: int = 32
  n_wordings: int = 2
  n_plain_relations: int = 4
  one_lesson_per_question: bool = True
  zipf_exponent: float = 1.0
  expert_rate_lo: float = 0.003
  expert_rate_hi: float = 0.9
  expert_rate_spacing: str = "log"
  n_test: int = 512
  balanced_test: bool = True


@dataclasses.dataclass(frozen=True)
class DataSection:
  train_path: str
  test_path: str
  format: str
  eval_size: int
  train_hops: str


@dataclasses.dataclass(frozen=True)
class RetrieverSection:
  kind: str
  index_path: str
  url: str
  topk: int
  timeout_s: float
  retries: int
  backoff_s: float
  max_backoff_s: float
  batch_size: int
  concurrency: int
  health_check: bool


@dataclasses.dataclass(frozen=True)
class EnvSection:
  reward: str
  max_turns: int
  max_turn_tokens: int
  max_obs_tokens: int
  max_obs_bytes: int
  max_seq_len: int


@dataclasses.dataclass(frozen=True)
class SftSection:
  num_traces: int
  steps: int
  batch_rows: int
  row_len: int
  lr: float
  warmup: int
  min_lr_ratio: float
  seed: int
  traces: str = "expert"  # SFT_TRACES


@dataclasses.dataclass(frozen=True)
class RolloutSection:
  prompts_per_step: int
  candidate_prompts: int
  root_budget: int
  min_per_prompt: int
  max_per_prompt: int
  prefix_budget: int
  max_per_anchor: int
  budget_unit: str
  tree_lambda: float
  blend_prior: float
  anchor_posterior: bool
  anchor_prior_strength: float
  root_anchors: bool
  cost_aware: bool
  explore_prompts: int
  hard_prompts: int
  metric_slice: int
  metric_rollouts: int
  calibrate: str
  calibrate_window: int
  calibrate_prior: float
  dapo_oversample: float
  arpo_entropy_top: float
  temperature: float
  top_p: float
  top_k: int
  num_slots: int
  page_size: int
  num_pages: int
  prefill_chunk: int
  tree_attention: bool
  root_objective: str
  root_concentration: float
  discovery_beta: float
  anchors: str
  stage2: str
  stage2_deadline: float
  keep_pool_kv: bool
  off_policy_steps: int = 0
  decode_steps: int = 8
  binned_bins: int = 8
  binned_window: int = 8


@dataclasses.dataclass(frozen=True)
class RLSection:
  steps: int
  lr: float
  predictor_lr: float
  advantage: str
  normalize_std: bool
  eps_low: float
  eps_high: float
  kl_coef: float
  entropy_coef: float
  max_grad_norm: float
  micro_batches: int
  train_rows: int
  predictor_warmup_steps: int
  predictor_fit_steps: int
  predictor_buffer_steps: int
  predictor_root_buffer_steps: int
  predictor_refresh_roots: bool
  predictor_leaf_weight: float
  remat: str
  predictor_weighting: str
  predictor_warm_steps: int
  max_consecutive_skips: int
  max_param_growth: float
  tree_values: str
  ppo_epochs: int
  minibatches: int
  predictor_slice: bool
  predictor_holdout: float
  predictor_ensemble: int
  packing: str
  pack_row_len: int


@dataclasses.dataclass(frozen=True)
class EvalSection:
  every: int
  size: int
  probe_prompts: int
  stop_on_collapse: bool


@dataclasses.dataclass(frozen=True)
class CkptSection:
  every: int
  max_to_keep: int


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything a run reads. `method` is a name in `trace_jax.allocation.strategies`' registry."""
  variant: str
  task: str  # TASKS
  method: str
  seed: int
  workdir: str
  mesh: str
  model: ModelSection
  world: WorldSection
  data: DataSection
  retriever: RetrieverSection
  env: EnvSection
  sft: SftSection
  rollout: RolloutSection
  rl: RLSection
  eval: EvalSection
  ckpt: CkptSection

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  def replace(self, **changes) -> "TrainConfig":
    """A copy with top-level fields or whole sections changed (`dataclasses.replace`)."""
    return dataclasses.replace(self, **changes)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "TrainConfig":
    """Builds the config from a nested mapping holding exactly the dataclasses' fields; each value
    is checked against its field's type (an int is accepted for a float). Raises ValueError naming
    the first missing, unknown or mistyped field."""
    return _build(cls, d, "")


_SCALARS = {"int": int, "float": float, "bool": bool, "str": str}


def _build(cls, d: Mapping[str, Any], where: str):
  if not hasattr(d, "keys"):
    raise ValueError(f"config{where}: expected a section, got {d!r}")
  fields = {f.name: f for f in dataclasses.fields(cls)}
  hints = typing.get_type_hints(cls)
  unknown = sorted(set(d.keys()) - set(fields))
  if unknown:
    raise ValueError(f"config{where}: unknown field(s) {unknown}; known: {sorted(fields)}")
  missing = sorted(set(fields) - set(d.keys()))
  if missing:
    raise ValueError(f"config{where}: missing field(s) {missing}")
  out = {}
  for name in fields:
    t, v, path = hints[name], d[name], f"{where}.{name}"
    if dataclasses.is_dataclass(t):
      out[name] = _build(t, v, path)
    else:
      out[name] = _scalar(t, v, path)
  return cls(**out)


def _scalar(t, v, path: str):
  name = t.__name__
  ok = {"bool": isinstance(v, bool),
        "int": isinstance(v, int) and not isinstance(v, bool),
        "float": isinstance(v, (int, float)) and not isinstance(v, bool),
        "str": isinstance(v, str)}[name]
  if not ok:
    raise ValueError(f"config{path}={v!r}: expected {name}")
  return float(v) if name == "float" else v


# ---- the parts' own configs, read from a run's --------------------------------------------------
def sampler_config(c: TrainConfig, **overrides):
  """The sampler engine's settings (`SamplerConfig`) of run config `c`: its rollout and env
  sections; `overrides` replace any of them."""
  from trace_jax.sampling.config import SamplerConfig

  r = c.rollout
  kw = dict(num_slots=r.num_slots, page_size=r.page_size, num_pages=r.num_pages,
            max_seq_len=c.env.max_seq_len, max_turn_tokens=c.env.max_turn_tokens,
            max_obs_tokens=c.env.max_obs_tokens, max_turns=c.env.max_turns,
            prefill_chunk=(32, r.prefill_chunk), temperature=r.temperature, top_p=r.top_p,
            top_k=r.top_k, use_tree_attention=r.tree_attention, seed=c.seed,
            decode_steps=r.decode_steps,
            prompt_mean_features=c.model.predictor_features == "last+prompt_mean")
  return SamplerConfig(**{**kw, **overrides})


def update_config(c: TrainConfig, **overrides):
  """The update step's settings (`UpdateConfig`) of run config `c`: its rl and model sections.
  Log-probs are the sampling policy's, softmax(z / T), as the sampler records them."""
  from trace_jax.rl.update import UpdateConfig

  kw = dict(lr=c.rl.lr, predictor_lr=c.rl.predictor_lr, eps_low=c.rl.eps_low,
            eps_high=c.rl.eps_high, kl_coef=c.rl.kl_coef, entropy_coef=c.rl.entropy_coef,
            max_grad_norm=c.rl.max_grad_norm, micro_batches=c.rl.micro_batches,
            remat=c.rl.remat, param_dtype=c.model.param_dtype,
            temperature=c.rollout.temperature,
            prompt_mean_features=c.model.predictor_features == "last+prompt_mean")
  return UpdateConfig(**{**kw, **overrides})


def driver_config(c: TrainConfig):
  """The rollout driver's settings (`DriverConfig`) of run config `c`: its method and rollout
  section, and whether the random slice counts in the ledger (when it steers: rollout.calibrate
  = platt or rl.predictor_slice)."""
  from trace_jax.allocation.driver import DriverConfig

  d = DriverConfig.from_rollout(c.method, c.rollout)
  # The slice steers the run when stage 1 is calibrated on it or the head is fit on its trees;
  # then its rollouts are part of the method's cost.
  steers = c.rollout.calibrate == "platt" or c.rl.predictor_slice
  return dataclasses.replace(d, count_slice=steers)



__all__ = ["CkptSection", "driver_config", "sampler_config", "update_config", "DataSection",
           "EnvSection", "EvalSection", "ModelSection", "RLSection",
           "RetrieverSection", "RolloutSection", "SftSection", "TrainConfig", "WorldSection"]
