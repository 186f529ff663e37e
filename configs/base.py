"""The common base of every config file in this package.

`base_config()` is the run config every task and variant starts from; a task's file
(`mhqa.py`, `tool_math.py`, `fc.py`) selects its variant and overrides values. `validate(c)` turns
any of them into the library's typed `trace_jax.config.TrainConfig` (`convert.py`).
"""

import ml_collections

from configs import convert
from trace_jax.config import TrainConfig, WorldSection

DEFAULT_TRAP_RATE = WorldSection.trap_rate  # the world of every earlier result


def base_config():
  """The run config every task and variant starts from: the typed defaults of
  `trace_jax.config.TrainConfig`, where every knob is defined once (its default, the values it
  allows and a one-line doc; `configs/README.md` lists them). Config files override values."""
  return ml_collections.ConfigDict(TrainConfig().to_dict())


def apply_smoke(c) -> None:
  """Shrinks `c` to the smoke size: a few steps of the same loop at toy size (CI)."""
  c.world.cache_dir = "cache/smoke"
  c.sft.num_traces = 600
  c.sft.steps = 8
  c.sft.batch_rows = 4
  c.sft.row_len = 256
  c.rollout.prompts_per_step = 4
  c.rollout.candidate_prompts = 6
  c.rollout.root_budget = 12
  c.rollout.prefix_budget = 6
  c.rollout.num_slots = 8
  c.rollout.num_pages = 1024
  c.rl.steps = 2
  c.rl.micro_batches = 1
  c.rl.train_rows = 12
  c.eval.every = 2
  c.eval.size = 8
  c.eval.probe_prompts = 4
  c.ckpt.every = 1


def tool_task_config(task: str, variant: str | None, *, max_turn_tokens: int, max_obs_tokens: int,
                     max_seq_len: int, eval_size: int, num_traces: int, sft_steps: int):
  """The base config of an embedded tool task (`configs/tool_math.py`, `configs/fc.py`): `task`, its
  turn and sequence sizes, the expert's correct-method rates over [0.2, 0.7], and, in the tiny
  variant, its evaluation size and warm start (traces and SFT steps)."""
  variant = variant or "tiny"
  if variant not in ("tiny", "smoke"):
    raise ValueError(f"unknown variant {variant!r}; choose tiny or smoke")
  c = base_config()
  c.variant = variant
  if variant == "smoke":
    apply_smoke(c)
  c.task = task
  c.world.expert_rate_lo = 0.2
  c.world.expert_rate_hi = 0.7
  # env.max_turns stays 5: up to three tool calls and the answer, one to spare
  c.env.max_turn_tokens = max_turn_tokens  # digits are one token each
  c.env.max_obs_tokens = max_obs_tokens
  c.env.max_seq_len = max_seq_len
  c.sft.row_len = max_seq_len
  if variant == "tiny":
    c.eval.size = eval_size
    c.sft.num_traces = num_traces
    c.sft.steps = sft_steps
  return c


def validate(c):
  """Checks every value of `c` (a ConfigDict of this package) and returns the run's typed
  `trace_jax.config.TrainConfig`; raises ValueError naming the first bad field."""
  return convert.to_train_config(c)
