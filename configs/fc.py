"""Function calling: chained calls to a stateful synthetic API (`trace_jax/envs/tasks/fc_world.py`).

  python launch/train.py --config=configs/fc.py                    # warm start + RL, CPU
  python launch/train.py --config=configs/fc.py:smoke              # a few steps at toy size
  python launch/train.py --config=configs/fc.py --config.method=grpo

The same schema as `configs/mhqa.py` (`get_config` starts from `configs/base.py`), with `task="fc"`:
the world section's seed and expert rates shape the embedded tasks (each template's correct
procedure is the expert's at a rate evenly spaced over [expert_rate_lo, expert_rate_hi]); the
retriever section is unused. Held-out EM is the environment's reward (the final state and the
answer), also per template (`eval_em_group/<template>`).
"""

from configs.base import tool_task_config, validate

__all__ = ["get_config", "validate"]


def get_config(arg: str | None = None):
  # 1000 warm-start steps: at 500 the tiny model copies ids and numbers from responses into
  # calls and answers, or not, by its seed (greedy held-out EM 0.05 / 0.20 / 0.30 for sft seeds
  # 0-2), and RL from there does not learn; at 1000 every seed tried (0-2) copies them (greedy
  # EM 0.51-0.52, balance solved) and only the procedures are left to learn
  # (projects/tool_tasks/README.md).
  return tool_task_config("fc", arg, max_turn_tokens=56, max_obs_tokens=32, max_seq_len=384,
                          eval_size=400, num_traces=12000, sft_steps=1000)

