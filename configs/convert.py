"""From a config file's ConfigDict to the library's typed `trace_jax.config.TrainConfig`.

`to_train_config(c)` is the one door between the two: it checks that every field exists with its
type, that every number is finite, and every value that can only fail later (intervals, budgets,
choices, paths) is in range, so a bad value fails in seconds with the field named instead of after
the first RL step.
`configs/runs.py` reads back the config a run was trained with.
"""

from __future__ import annotations

import math
import os

from trace_jax.allocation.allocators import ROOT_OBJECTIVES
from trace_jax.config import TrainConfig, check_knobs, knob_error
from trace_jax.rl.advantages import VALUE_ESTIMATORS
from trace_jax.rl.batch import PACKINGS

def to_train_config(c) -> TrainConfig:
  """The typed config of ConfigDict (or nested dict) `c`, every value checked (`validate`)."""
  d = c.to_dict() if hasattr(c, "to_dict") else dict(c)
  tc = TrainConfig.from_dict(d)
  _check_finite(tc.to_dict(), "")
  validate(tc)
  return tc


def _check_finite(d: dict, where: str) -> None:
  for k, v in d.items():
    if isinstance(v, dict):
      _check_finite(v, f"{where}{k}.")
    elif isinstance(v, float) and not math.isfinite(v):
      raise ValueError(f"{where}{k}={v!r} must be a finite number")


REQUIRED_REAL = ("model.path", "data.train_path", "data.test_path")


def validate(c: TrainConfig) -> None:
  """Clear errors for settings that cannot work, before anything is built or compiled.

  Each field is checked against its own definition in `trace_jax.config` (its choices or bounds:
  `check_knobs`); this function adds what relates several fields, the choices other modules own
  (methods, root objectives, value estimators, packings) and the files a real run reads. So a bad
  value fails in seconds with the field named instead of after the first RL step.
  Notes: `rl.steps=0` is allowed (warm start and the first evaluation only);
  `rollout.temperature` must be > 0, since RL samples (evaluation is always greedy): for nearly
  greedy rollouts use a small temperature or `rollout.top_k=1`.
  """
  from trace_jax.allocation import strategies

  if c.method not in strategies.names():
    raise ValueError(f"config.method={c.method!r}; choose one of {strategies.names()}")
  from trace_jax import tasks

  if c.task not in tasks.names():
    raise ValueError(f"config.task={c.task!r}; choose one of {tasks.names()} (a task of your "
                     f"own: trace_jax.tasks.register)")
  from trace_jax.assets import uses_real_data  # the real variants' names live with the loaders

  synthetic = not uses_real_data(c)
  if not synthetic:
    missing = [k for k in REQUIRED_REAL if not _get(c, k)]
    if c.retriever.kind == "http" and not c.retriever.url:
      missing.append("retriever.url")
    if c.retriever.kind == "bm25" and not c.retriever.index_path:
      missing.append("retriever.index_path")
    if missing:
      raise ValueError(
          f"variant {c.variant} needs local paths: set " +
          ", ".join(f"--config.{k}=..." for k in missing))
  check_knobs(c)
  _check(c, "rollout.root_objective", choices=ROOT_OBJECTIVES)
  _check(c, "rl.tree_values", choices=VALUE_ESTIMATORS)
  _check(c, "rl.packing", choices=PACKINGS)

  # ---- retriever
  rt = c.retriever
  if rt.kind == "world" and not synthetic:
    raise ValueError(f"retriever.kind='world' needs the synthetic world; variant {c.variant} "
                     f"uses real data: set --config.retriever.kind=http or bm25")
  if rt.kind == "http":
    if not rt.url:
      raise ValueError("retriever.kind='http' needs --config.retriever.url=http://HOST:PORT")
    if not rt.url.startswith(("http://", "https://")):
      raise ValueError(f"retriever.url={rt.url!r} must start with http:// or https://")

  # ---- environment
  e = c.env
  if e.max_obs_bytes != 0:
    _check(c, "env.max_obs_bytes", ge=64, note="(or 0 for no cap)")
  if e.max_seq_len <= e.max_turn_tokens:
    raise ValueError(f"env.max_seq_len={e.max_seq_len} must exceed env.max_turn_tokens="
                     f"{e.max_turn_tokens}")

  from trace_jax.assets import parse_hops
  parse_hops(c.data.train_hops)  # raises on a malformed list

  # ---- rollouts and budgets
  r = c.rollout
  if r.explore_prompts + r.hard_prompts > r.prompts_per_step:
    raise ValueError(f"rollout.explore_prompts={r.explore_prompts} + rollout.hard_prompts="
                     f"{r.hard_prompts} is more than prompts_per_step={r.prompts_per_step}: the "
                     "forced slots are part of the step's prompts")
  if r.calibrate != "none" and r.metric_slice <= 0:
    raise ValueError("rollout.calibrate needs rollout.metric_slice > 0 (the random slice whose "
                     "outcomes it is fit on)")
  if not (r.temperature > 0 and math.isfinite(r.temperature)):
    raise ValueError(f"rollout.temperature={r.temperature} must be a finite number > 0 (RL needs "
                     f"sampled rollouts; evaluation is already greedy). For nearly greedy "
                     f"rollouts use a small temperature such as 0.1, or --config.rollout.top_k=1")
  if r.max_per_prompt < r.min_per_prompt:
    raise ValueError(f"rollout.max_per_prompt={r.max_per_prompt} is smaller than "
                     f"min_per_prompt={r.min_per_prompt}")
  if r.root_budget < r.min_per_prompt * r.prompts_per_step:
    raise ValueError(f"rollout.root_budget={r.root_budget} is smaller than min_per_prompt x "
                     f"prompts_per_step = {r.min_per_prompt * r.prompts_per_step}")
  if r.root_budget > r.max_per_prompt * r.prompts_per_step:
    raise ValueError(f"rollout.root_budget={r.root_budget} is larger than max_per_prompt x "
                     f"prompts_per_step = {r.max_per_prompt * r.prompts_per_step}")
  if 0 < r.candidate_prompts < r.prompts_per_step:
    raise ValueError(f"rollout.candidate_prompts={r.candidate_prompts} must be 0 or at least "
                     f"prompts_per_step={r.prompts_per_step}")
  if r.stage2 == "stream" and r.budget_unit != "rollouts":
    raise ValueError("rollout.stage2=stream needs rollout.budget_unit=rollouts (a token budget is "
                     "priced by the whole step's rollout lengths, known only when stage 1 ends)")

  # ---- RL
  if c.rl.predictor_ensemble == 2:
    raise ValueError("rl.predictor_ensemble=2 leaves one bootstrap member beside the model's head, "
                     "which has no spread: use 1 (no uncertainty) or at least 3")
  if c.rl.pack_row_len and c.rl.pack_row_len < c.env.max_seq_len:
    raise ValueError(f"rl.pack_row_len={c.rl.pack_row_len} must be 0 or at least env.max_seq_len="
                     f"{c.env.max_seq_len} (a root path must fit one row)")

  # ---- LoRA (trace_jax/models/lora.py)
  lo = c.model.lora
  if lo.rank > 0:
    from trace_jax.models.lora import parse_targets
    parse_targets(lo.targets)  # names an unknown projection
    if lo.dropout > 0:
      raise ValueError(f"model.lora.dropout={lo.dropout}: only 0 is supported (the jitted update "
                       f"takes no rng, so a dropout mask could not be replayed on resume)")

  # ---- the lessons world
  w = c.world
  if not 1 <= w.n_relations + w.n_plain_relations <= 40 or w.n_relations < 1:
    raise ValueError(f"world.n_relations={w.n_relations} (>= 1) and n_plain_relations="
                     f"{w.n_plain_relations} must add up to at most 40")
  if w.one_lesson_per_question != (w.n_plain_relations > 0):
    raise ValueError("world.one_lesson_per_question and world.n_plain_relations > 0 go together "
                     "(plain relations are a question's other hops)")
  if w.balanced_test and not w.one_lesson_per_question:
    raise ValueError("world.balanced_test needs world.one_lesson_per_question")
  if w.expert_rate_spacing == "log" and w.expert_rate_lo <= 0:
    raise ValueError(f"world.expert_rate_lo={w.expert_rate_lo} must be > 0 with log spacing")
  if not 0 <= w.expert_rate_lo <= w.expert_rate_hi <= 1:
    raise ValueError(f"world.expert_rate_lo={w.expert_rate_lo} and expert_rate_hi="
                     f"{w.expert_rate_hi} must satisfy 0 <= lo <= hi <= 1")
  if not synthetic:
    _check_data_file(c, "data.train_path")
    _check_data_file(c, "data.test_path")
    from trace_jax.assets import check_model_dir  # names the file an incomplete directory lacks
    check_model_dir(c.model.path, c.model.tokenizer_path)


def _get(c, dotted):
  for k in dotted.split("."):
    c = getattr(c, k)
  return c


def _check(c, dotted, **allowed):
  """Raises the message of `trace_jax.config.knob_error` when field `dotted` is outside `allowed`
  (choices= or bounds): for checks that depend on other fields or on choices other modules own."""
  err = knob_error(dotted, _get(c, dotted), allowed)
  if err:
    raise ValueError(err)


def _check_data_file(c, dotted):
  path = _get(c, dotted)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{dotted}={path}: no such file")
  if os.path.isdir(path):
    raise IsADirectoryError(f"{dotted}={path}: a directory; give the data file itself")
  if os.path.getsize(path) == 0:
    raise ValueError(f"{dotted}={path}: the file is empty")
