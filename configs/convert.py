"""From a config file's ConfigDict to the library's typed `trace_jax.config.TrainConfig`.

`to_train_config(c)` is the one door between the two: it checks that every field exists with its
type, that every number is finite, and every value that can only fail later (intervals, budgets,
choices, paths) is in range, so a bad value fails in seconds with the field named instead of after
the first RL step. `load_run_config(workdir)` reads back the config a run was trained with.
"""

from __future__ import annotations

import json
import math
import os

from trace_jax.allocation.allocators import ROOT_OBJECTIVES
from trace_jax.config import SFT_TRACES, TASKS, WORLD_KINDS, TrainConfig
from trace_jax.rl.advantages import VALUE_ESTIMATORS
from trace_jax.rl.batch import PACKINGS

def to_train_config(c) -> TrainConfig:
  """The typed config of ConfigDict (or nested dict) `c`, every value checked (`validate`)."""
  d = c.to_dict() if hasattr(c, "to_dict") else dict(c)
  tc = TrainConfig.from_dict(d)
  _check_finite(tc.to_dict(), "")
  validate(tc)
  return tc


def load_run_config(workdir: str) -> TrainConfig:
  """The config a training run was trained with (its workdir's config.json), typed. Fields added
  to the config file since the run was made take their variant's current default; fields it no
  longer has are dropped. Values are type-checked, not validated (its paths may be gone)."""
  return TrainConfig.from_dict(load_run_config_dict(workdir))


def load_run_config_dict(workdir: str) -> dict:
  """`load_run_config` as a nested dict (for a launcher that changes fields before typing it)."""
  import mhqa

  if not os.path.isdir(workdir):
    raise FileNotFoundError(f"--workdir={workdir!r} does not exist")
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} not found: --workdir must be a training run directory "
                            f"(launch/train.py writes config.json there)")
  with open(path) as f:
    saved = json.load(f)
  base = mhqa.get_config(saved.get("variant") or None).to_dict()
  return _overlay(base, saved)


def _overlay(base: dict, saved: dict) -> dict:
  out = {}
  for k, v in base.items():
    if isinstance(v, dict):
      out[k] = _overlay(v, saved.get(k) or {})
    else:
      out[k] = saved.get(k, v)
  return out


def _check_finite(d: dict, where: str) -> None:
  for k, v in d.items():
    if isinstance(v, dict):
      _check_finite(v, f"{where}{k}.")
    elif isinstance(v, float) and not math.isfinite(v):
      raise ValueError(f"{where}{k}={v!r} must be a finite number")


REQUIRED_REAL = ("model.path", "data.train_path", "data.test_path")
RETRIEVERS = ("world", "bm25", "http")
ADVANTAGES = ("tree_contrastive", "grpo", "tree_grpo", "treerl")


def validate(c: TrainConfig) -> None:
  """Clear errors for settings that cannot work, before anything is built or compiled.

  Every interval, count and budget that the loop divides by or allocates from is checked here,
  so a bad value fails in seconds with the field named instead of after the first RL step.
  Notes: `rl.steps=0` is allowed (warm start and the evaluation before RL only);
  `rollout.temperature` must be > 0, since RL samples (evaluation is always greedy): for nearly
  greedy rollouts use a small temperature or `rollout.top_k=1`.
  """
  from trace_jax.allocation import strategies

  if c.method not in strategies.names():
    raise ValueError(f"config.method={c.method!r}; choose one of {strategies.names()}")
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

  # ---- retriever
  rt = c.retriever
  _choice(c, "retriever.kind", RETRIEVERS)
  if rt.kind == "world" and not synthetic:
    raise ValueError(f"retriever.kind='world' needs the synthetic world; variant {c.variant} "
                     f"uses real data: set --config.retriever.kind=http or bm25")
  if rt.kind == "http":
    if not rt.url:
      raise ValueError("retriever.kind='http' needs --config.retriever.url=http://HOST:PORT")
    if not rt.url.startswith(("http://", "https://")):
      raise ValueError(f"retriever.url={rt.url!r} must start with http:// or https://")
  _at_least(c, "retriever.topk", 1)
  _at_least(c, "retriever.retries", 0)
  _at_least(c, "retriever.batch_size", 1)
  _at_least(c, "retriever.concurrency", 1)
  _positive(c, "retriever.timeout_s")
  _at_least(c, "retriever.backoff_s", 0)
  _at_least(c, "retriever.max_backoff_s", 0)

  # ---- environment
  e = c.env
  _at_least(c, "env.max_turns", 1)
  _at_least(c, "env.max_turn_tokens", 1)
  _at_least(c, "env.max_obs_tokens", 4)  # room for the tags and a little text
  if e.max_obs_bytes != 0:
    _at_least(c, "env.max_obs_bytes", 64, "(or 0 for no cap)")
  if e.max_seq_len <= e.max_turn_tokens:
    raise ValueError(f"env.max_seq_len={e.max_seq_len} must exceed env.max_turn_tokens="
                     f"{e.max_turn_tokens}")

  from trace_jax.assets import parse_hops
  parse_hops(c.data.train_hops)  # raises on a malformed list

  # ---- rollouts and budgets
  r = c.rollout
  for k in ("prompts_per_step", "min_per_prompt", "root_budget", "max_per_anchor", "num_slots",
            "page_size", "prefill_chunk"):
    _at_least(c, f"rollout.{k}", 1)
  _at_least(c, "rollout.num_pages", 2)
  _at_least(c, "rollout.prefix_budget", 0)
  _at_least(c, "rollout.candidate_prompts", 0)
  _at_least(c, "rollout.explore_prompts", 0)
  _at_least(c, "rollout.hard_prompts", 0)
  if r.explore_prompts + r.hard_prompts > r.prompts_per_step:
    raise ValueError(f"rollout.explore_prompts={r.explore_prompts} + rollout.hard_prompts="
                     f"{r.hard_prompts} is more than prompts_per_step={r.prompts_per_step}: the "
                     "forced slots are part of the step's prompts")
  _at_least(c, "rollout.top_k", 0)
  _at_least(c, "rollout.tree_lambda", 0)
  _at_least(c, "rollout.blend_prior", 0)
  _at_least(c, "rollout.dapo_oversample", 1)
  _choice(c, "rollout.budget_unit", ("rollouts", "tokens"))
  _choice(c, "rollout.calibrate", ("none", "platt"))
  _at_least(c, "rollout.calibrate_window", 1)
  _at_least(c, "rollout.calibrate_prior", 0)
  if r.calibrate != "none" and r.metric_slice <= 0:
    raise ValueError("rollout.calibrate needs rollout.metric_slice > 0 (the random slice whose "
                     "outcomes it is fit on)")
  if not 0 < r.arpo_entropy_top <= 1:
    raise ValueError(f"rollout.arpo_entropy_top={r.arpo_entropy_top} must be in (0, 1]")
  if not 0 < r.top_p <= 1:
    raise ValueError(f"rollout.top_p={r.top_p} must be in (0, 1]")
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

  # ---- RL, evaluation, checkpoints
  _at_least(c, "rl.steps", 0, "(0 runs the warm start and the first evaluation only)")
  _at_least(c, "rl.micro_batches", 1)
  _at_least(c, "rl.train_rows", 1)
  _at_least(c, "rl.predictor_fit_steps", 0)
  _at_least(c, "rl.predictor_buffer_steps", 1)
  _at_least(c, "rl.predictor_root_buffer_steps", 1)
  _at_least(c, "rl.predictor_warm_steps", 0)
  _at_least(c, "rl.predictor_warmup_steps", 0)
  _at_least(c, "rl.eps_low", 0)
  _at_least(c, "rl.eps_high", 0)
  _at_least(c, "rl.kl_coef", 0)
  _choice(c, "rl.advantage", ADVANTAGES)
  _choice(c, "rl.predictor_weighting", ("uniform", "visits"))
  _choice(c, "model.predictor_features", ("last", "last+prompt_mean"))
  for k in ("lr", "predictor_lr", "max_grad_norm", "max_param_growth"):
    _positive(c, f"rl.{k}")
  _at_least(c, "rl.entropy_coef", 0)
  _at_least(c, "rl.predictor_leaf_weight", 0)
  _at_least(c, "rl.max_consecutive_skips", 1)
  _choice(c, "rl.remat", ("none", "full", "dots"))
  _choice(c, "rl.tree_values", VALUE_ESTIMATORS)
  _choice(c, "rl.packing", PACKINGS)
  if c.rl.pack_row_len and c.rl.pack_row_len < c.env.max_seq_len:
    raise ValueError(f"rl.pack_row_len={c.rl.pack_row_len} must be 0 or at least env.max_seq_len="
                     f"{c.env.max_seq_len} (a root path must fit one row)")
  _at_least(c, "rl.ppo_epochs", 1)
  _at_least(c, "rl.minibatches", 1)
  _at_least(c, "rl.predictor_ensemble", 1)
  if not 0.0 <= c.rl.predictor_holdout < 1.0:
    raise ValueError(f"rl.predictor_holdout={c.rl.predictor_holdout} must be in [0, 1)")
  _choice(c, "rollout.root_objective", ROOT_OBJECTIVES)
  _positive(c, "rollout.root_concentration")
  _at_least(c, "rollout.binned_bins", 1)
  _at_least(c, "rollout.binned_window", 1)
  _at_least(c, "rollout.discovery_beta", 0)
  _choice(c, "rollout.anchors", ("all", "before_tool_call"))
  _choice(c, "rollout.stage2", ("batch", "stream"))
  _choice(c, "rollout.off_policy_steps", (0, 1))
  _at_least(c, "rollout.decode_steps", 1)
  if not 0.0 <= c.rollout.stage2_deadline < 1.0:
    raise ValueError(f"rollout.stage2_deadline={c.rollout.stage2_deadline} must be in [0, 1)")
  if c.rollout.stage2 == "stream" and c.rollout.budget_unit != "rollouts":
    raise ValueError("rollout.stage2=stream needs rollout.budget_unit=rollouts (a token budget is "
                     "priced by the whole step's rollout lengths, known only when stage 1 ends)")
  _choice(c, "model.dtype", ("float32", "bfloat16", "float16"))
  _choice(c, "model.param_dtype", ("float32", "bfloat16", "float16"))
  for k in ("hidden_size", "num_layers", "intermediate_size", "predictor_hidden"):
    _at_least(c, f"model.{k}", 1)
  _choice(c, "env.reward", ("em", "f1", "em_format"))
  _at_least(c, "data.eval_size", 1)
  _positive(c, "rollout.anchor_prior_strength")
  _at_least(c, "rollout.metric_slice", 0)
  _at_least(c, "rollout.metric_rollouts", 0)
  if not 0 <= c.world.trap_rate <= 1:
    raise ValueError(f"world.trap_rate={c.world.trap_rate} must be in [0, 1]")
  _choice(c, "task", TASKS)
  _choice(c, "world.kind", WORLD_KINDS)
  _choice(c, "sft.traces", SFT_TRACES)
  if not 1 <= c.world.n_relations + c.world.n_plain_relations <= 40 or c.world.n_relations < 1:
    raise ValueError(f"world.n_relations={c.world.n_relations} (>= 1) and n_plain_relations="
                     f"{c.world.n_plain_relations} must add up to at most 40")
  if c.world.one_lesson_per_question != (c.world.n_plain_relations > 0):
    raise ValueError("world.one_lesson_per_question and world.n_plain_relations > 0 go together "
                     "(plain relations are a question's other hops)")
  if c.world.balanced_test and not c.world.one_lesson_per_question:
    raise ValueError("world.balanced_test needs world.one_lesson_per_question")
  _choice(c, "world.expert_rate_spacing", ("linear", "log"))
  if c.world.expert_rate_spacing == "log" and c.world.expert_rate_lo <= 0:
    raise ValueError(f"world.expert_rate_lo={c.world.expert_rate_lo} must be > 0 with log spacing")
  _at_least(c, "world.n_test", 1)
  _at_least(c, "world.n_wordings", 2, "(a fact verb and at least one decoy)")
  if c.world.zipf_exponent < 0:
    raise ValueError(f"world.zipf_exponent={c.world.zipf_exponent} must be >= 0")
  if not 0 <= c.world.expert_rate_lo <= c.world.expert_rate_hi <= 1:
    raise ValueError(f"world.expert_rate_lo={c.world.expert_rate_lo} and expert_rate_hi="
                     f"{c.world.expert_rate_hi} must satisfy 0 <= lo <= hi <= 1")
  _at_least(c, "eval.every", 1)
  _at_least(c, "eval.size", 1, "(an empty evaluation set has no accuracy)")
  _at_least(c, "ckpt.every", 1)
  _at_least(c, "ckpt.max_to_keep", 1)
  if synthetic:
    _at_least(c, "eval.probe_prompts", 1)
    for k in ("num_traces", "batch_rows", "row_len"):
      _at_least(c, f"sft.{k}", 1)
    _at_least(c, "sft.steps", 0)
    _at_least(c, "sft.warmup", 0)
    _positive(c, "sft.lr")
    if not 0 <= c.sft.min_lr_ratio <= 1:
      raise ValueError(f"sft.min_lr_ratio={c.sft.min_lr_ratio} must be in [0, 1]")
  else:
    _check_data_file(c, "data.train_path")
    _check_data_file(c, "data.test_path")
    from trace_jax.assets import check_model_dir  # names the file an incomplete directory lacks
    check_model_dir(c.model.path, c.model.tokenizer_path)


def _get(c, dotted):
  for k in dotted.split("."):
    c = getattr(c, k)
  return c


def _at_least(c, dotted, low, note=""):
  v = _get(c, dotted)
  if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= low:
    raise ValueError(f"{dotted}={v!r} must be >= {low}" + (f" {note}" if note else ""))


def _positive(c, dotted):
  v = _get(c, dotted)
  if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 and math.isfinite(v)):
    raise ValueError(f"{dotted}={v!r} must be a finite number > 0")


def _choice(c, dotted, choices):
  if _get(c, dotted) not in choices:
    raise ValueError(f"{dotted}={_get(c, dotted)!r}; choose one of {choices}")


def _check_data_file(c, dotted):
  path = _get(c, dotted)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{dotted}={path}: no such file")
  if os.path.isdir(path):
    raise IsADirectoryError(f"{dotted}={path}: a directory; give the data file itself")
  if os.path.getsize(path) == 0:
    raise ValueError(f"{dotted}={path}: the file is empty")
