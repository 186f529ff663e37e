"""Tasks behind one small interface, and their registry (`config.task` names one).

A `Task` gives a run what it trains on: `load(c) -> Assets` (its examples with their prompt
tokens, the tokenizer, the environment with its tools and reward, a retriever) and its warm-start
recipe: `traces(c, assets, n, rng)`, n expert traces to fine-tune on before RL, or None for no
warm start (a pretrained checkpoint, `model.path`, or a policy that is good enough already). It
also says which run-config fields it never reads (`unread`), so a launcher refuses a value given
to one of them instead of ignoring it.

The built-in tasks: `mhqa` (multi-hop QA with search: the synthetic worlds with their expert's
traces, or real data from local files and a pretrained checkpoint), `math` (tool-use math) and
`fc` (function calling). A task of your own:

>>> from trace_jax import tasks
>>> def load(c):  # examples, tokenizer and environment: see examples/unit_conversion.py
...   raise NotImplementedError
>>> units = tasks.register(tasks.Task("units_doc", load=load))
>>> tasks.get("units_doc") is units, "units_doc" in tasks.names()
(True, True)

then `trace_jax.train.train(c)` with `c.task = "units_doc"` (or `train(c, task=units)` without
registering it).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import numpy as np

from trace_jax import assets as assets_lib

# Segments of a trace: [(text, is_generated)] in the order the sampler sees them (the prompt, each
# generated turn, each observation); with whether its final answer is right.
Trace = tuple[list[tuple[str, bool]], bool]

# What a task of the caller's own does not read by default: the synthetic worlds, the search
# tools, the real-data loaders (it brings its own examples).
CUSTOM_UNREAD = tuple(["world.trap_rate", "world.kind"]
                      + [f"world.{k}" for k in assets_lib.LESSONS_FIELDS]
                      + ["retriever.kind", "retriever.index_path", "retriever.url",
                         "retriever.topk", "data.train_hops"] + list(assets_lib.REAL_FIELDS))


@dataclasses.dataclass(frozen=True)
class Task:
  """What a run trains on (see the module docstring).

  Args:
    name: the name `config.task` gives it.
    load: `load(c) -> trace_jax.assets.Assets` for run config `c`: examples (each with
      `prompt_ids`, `answers`, `id`), tokenizer (`encode`, `decode`, `bos_id`, `eos_id`,
      `vocab_size`), the environment (`env`, a `trace_jax.envs.interface.ToolEnv`) and whether
      held-out EM is the environment's reward (`reward_is_em`, the default) or exact match of the
      answer text.
    traces: `traces(c, assets, n, rng) -> [Trace]`: n expert traces of the train examples for the
      warm start (supervised fine-tuning before RL, cached under `world.cache_dir`); None: no
      warm start.
    unread: `unread(c) -> [dotted field]`: run-config fields this task never reads.
  """

  name: str
  load: Callable[[Any], assets_lib.Assets]
  traces: Optional[Callable[[Any, assets_lib.Assets, int, np.random.Generator], list]] = None
  unread: Callable[[Any], list] = lambda c: list(CUSTOM_UNREAD)

  def warm_starts(self, c) -> bool:
    """Whether a run of config `c` fine-tunes on this task's traces before RL."""
    return self.traces is not None


_REGISTRY: dict[str, Task] = {}


def register(task: Task) -> Task:
  """Adds `task` under its name (a name taken by another task is refused); returns it."""
  if not isinstance(task, Task):
    raise TypeError(f"register takes a trace_jax.tasks.Task, got {type(task).__name__}")
  old = _REGISTRY.get(task.name)
  if old is not None and old is not task:
    raise ValueError(f"task {task.name!r} is registered already")
  _REGISTRY[task.name] = task
  return task


def get(name: str) -> Task:
  """The task registered under `name`."""
  if name not in _REGISTRY:
    raise ValueError(f"unknown task {name!r}; registered: {names()} (a task of your own: "
                     f"trace_jax.tasks.register)")
  return _REGISTRY[name]


def names() -> list[str]:
  return sorted(_REGISTRY)


# ---- the built-in tasks ------------------------------------------------------------------------
def _mhqa_load(c) -> assets_lib.Assets:
  if assets_lib.uses_real_data(c):
    return assets_lib.load_real_assets(c)
  return assets_lib.load_world_assets(c)


def _world_traces(c, assets, n, rng, examples=None) -> list:
  """The synthetic world's expert traces (or, with `sft.traces=oracle`, the oracle's) on its
  train questions (or on `examples`)."""
  from trace_jax.envs.worlds.synthetic import make_sft_dataset, oracle_world

  world = assets.world if c.sft.traces == "expert" else oracle_world(assets.world)
  return [(r.segments(), r.trace.correct)
          for r in make_sft_dataset(world, n, rng, examples=examples)]


def _tool_traces(c, assets, n, rng, examples=None) -> list:
  """An embedded tool task's expert traces (the template's method at its expert rate)."""
  from trace_jax.envs.tasks.tool_tasks import EMBEDDED_TASKS

  expert = EMBEDDED_TASKS[c.task].expert
  pool = assets.world.train if examples is None else examples
  return [expert(assets.world, pool[int(i)], rng, oracle=c.sft.traces == "oracle")
          for i in rng.integers(len(pool), size=n)]


class _MultiHop(Task):
  def warm_starts(self, c) -> bool:  # a real checkpoint is its own warm start
    return not assets_lib.uses_real_data(c)


MHQA = register(_MultiHop("mhqa", load=_mhqa_load, traces=_world_traces,
                          unread=assets_lib.unread_fields))
MATH = register(Task("math", load=assets_lib.tool_task_assets, traces=_tool_traces,
                     unread=assets_lib.unread_fields))
FC = register(Task("fc", load=assets_lib.tool_task_assets, traces=_tool_traces,
                   unread=assets_lib.unread_fields))

__all__ = ["Task", "Trace", "get", "names", "register"]
