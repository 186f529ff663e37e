"""Function calling: chained calls to a stateful synthetic API (`trace_jax/envs/fc_world.py`).

  python launch/train.py --config=configs/fc.py                    # warm start + RL, CPU
  python launch/train.py --config=configs/fc.py:smoke              # a few steps at toy size
  python launch/train.py --config=configs/fc.py --config.method=grpo

The same schema as `configs/mhqa.py` (`get_config` starts from its base), with `task="fc"`: the
world section's seed and expert rates shape the embedded tasks (each template's correct
procedure is the expert's at a rate evenly spaced over [expert_rate_lo, expert_rate_hi]); the
retriever section is unused. Held-out EM is the environment's reward (the final state and the
answer), also per template (`eval_em_group/<template>`).
"""

import os
import sys

sys.path.append(os.path.dirname(os.path.abspath(__file__)))

import mhqa  # noqa: E402


def get_config(arg: str | None = None):
  variant = arg or "tiny"
  if variant not in ("tiny", "smoke"):
    raise ValueError(f"unknown variant {variant!r}; choose tiny or smoke")
  c = mhqa.get_config(variant)
  c.task = "fc"
  c.world.expert_rate_lo = 0.2
  c.world.expert_rate_hi = 0.7
  c.env.max_turns = 5          # up to three calls and the answer, one to spare
  c.env.max_turn_tokens = 56   # a JSON call, its digits one token each
  c.env.max_obs_tokens = 32
  c.env.max_seq_len = 384
  c.sft.row_len = 384
  if variant == "tiny":
    c.eval.size = 400
    c.sft.num_traces = 12000
    c.sft.steps = 300
  return c


def validate(c):
  """The typed `TrainConfig` of `c` (every value checked; see `configs/convert.py`)."""
  return mhqa.validate(c)
