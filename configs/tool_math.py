"""Tool-use math: word problems solved through a calculator (`trace_jax/envs/tasks/math_world.py`).

  python launch/train.py --config=configs/tool_math.py              # warm start + RL, CPU
  python launch/train.py --config=configs/tool_math.py:smoke        # a few steps at toy size
  python launch/train.py --config=configs/tool_math.py --config.method=grpo

The same schema as `configs/mhqa.py` (`get_config` starts from `configs/base.py`), with
`task="math"`: the world section's seed and expert rates shape the embedded problems (each
template's correct method is the expert's at a rate evenly spaced over [expert_rate_lo,
expert_rate_hi]); the retriever section is unused. Held-out EM is reported per template
(`eval_em_group/<template>`).
"""

from configs.base import tool_task_config, validate

__all__ = ["get_config", "validate"]


def get_config(arg: str | None = None):
  return tool_task_config("math", arg, max_turn_tokens=40, max_obs_tokens=24, max_seq_len=320,
                          eval_size=500, num_traces=16000, sft_steps=300)

