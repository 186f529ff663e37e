"""The embedded tool tasks beside multi-hop search, described alike so one loader serves them:
tool-use math (`math_world`) and function calling (`fc_world`). Each has a generator of problems
with expert traces and planted mistakes, a word-level tokenizer, a prompt, a `ToolEnv` and the
example fields its environment reads."""

from __future__ import annotations

import dataclasses
from typing import Callable

from trace_jax.envs.tasks import fc_world
from trace_jax.envs.tasks import math_world


@dataclasses.dataclass(frozen=True)
class EmbeddedTask:
  """name; world_config(seed=, expert_rate_range=) and generate(cfg) -> world; world_cls (with
  `save(dir)` and `load(dir)`) and the file it writes; tokenizer(world); question(problem) and
  prompt(problem) texts; fields(problem): what the environment reads besides `answers`;
  make_env(max_turns); expert(world, problem, rng, oracle) -> (segments, correct)."""

  name: str
  world_config: Callable
  generate: Callable
  world_cls: type
  file: str
  tokenizer: Callable
  question: Callable
  prompt: Callable
  fields: Callable
  make_env: Callable
  expert: Callable


EMBEDDED_TASKS = {
    "math": EmbeddedTask(
        "math", math_world.MathWorldConfig, math_world.generate_math_world,
        math_world.MathWorld, "math_world.json", math_world.build_math_tokenizer,
        question=lambda p: p.question, prompt=lambda p: math_world.math_prompt(p.question),
        fields=lambda p: {}, make_env=math_world.make_math_env,
        expert=math_world.expert_segments),
    "fc": EmbeddedTask(
        "fc", fc_world.FCWorldConfig, fc_world.generate_fc_world, fc_world.FCWorld,
        "fc_world.json", lambda world: fc_world.build_fc_tokenizer(),
        question=lambda p: p.task, prompt=lambda p: fc_world.fc_prompt(p.task),
        fields=lambda p: {"state": p.state, "expected_state": p.expected_state},
        make_env=fc_world.make_fc_env, expert=fc_world.expert_segments),
}

__all__ = ["EMBEDDED_TASKS", "EmbeddedTask"]
