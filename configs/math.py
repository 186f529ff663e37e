"""Tool-use math: word problems solved through a calculator (`trace_jax/envs/math_world.py`).

  python launch/train.py --config=configs/math.py                  # warm start + RL, CPU
  python launch/train.py --config=configs/math.py:smoke            # a few steps at toy size
  python launch/train.py --config=configs/math.py --config.method=grpo

The same schema as `configs/mhqa.py` (`get_config` starts from its base), with `task="math"`: the
world section's seed and expert rates shape the embedded problems (each template's correct
method is the expert's at a rate evenly spaced over [expert_rate_lo, expert_rate_hi]); the
retriever section is unused. Held-out EM is reported per template (`eval_em_group/<template>`).
"""

import os
import sys

sys.path.append(os.path.dirname(os.path.abspath(__file__)))

import mhqa  # noqa: E402


def get_config(arg: str | None = None):
  return mhqa.tool_task_config("math", arg, max_turn_tokens=40, max_obs_tokens=24, max_seq_len=320,
                               eval_size=500, num_traces=16000, sft_steps=300)


def validate(c):
  """The typed `TrainConfig` of `c` (every value checked; see `configs/convert.py`)."""
  return mhqa.validate(c)
