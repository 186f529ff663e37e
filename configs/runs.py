"""The config a training run was trained with, read back from its workdir's `config.json`.

Fields added to the config files since the run was made take their task and variant's current
default; fields they no longer have are dropped.
"""

from __future__ import annotations

import json
import os

from configs import fc, mhqa, tool_math
from trace_jax.config import TrainConfig

# The config file of each task (`config.task`).
TASK_CONFIGS = {"mhqa": mhqa, "math": tool_math, "fc": fc}


def task_config(task: str, variant: str | None = None):
  """The ConfigDict of `task`'s config file at `variant`."""
  if task not in TASK_CONFIGS:
    raise ValueError(f"unknown task {task!r}; choose one of {sorted(TASK_CONFIGS)}")
  return TASK_CONFIGS[task].get_config(variant or None)


def check_overrides(c) -> None:
  """Refuses a value the run would ignore: a field `c` sets away from its task and variant's own
  value that a run of this variant never reads (`trace_jax.assets.unread_fields`), such as
  `--config.data.train_path` on a synthetic variant. Raises ValueError naming them."""
  from trace_jax.assets import unread_fields

  mine = TrainConfig.from_dict(c.to_dict() if hasattr(c, "to_dict") else dict(c))
  ref = task_config(mine.task, mine.variant).to_dict()
  given = mine.to_dict()
  changed = []
  for name in unread_fields(mine):
    sec, field = name.split(".")
    if given[sec][field] != ref[sec][field]:
      changed.append(f"--config.{name}={given[sec][field]!r}")
  if changed:
    raise ValueError(f"variant {mine.variant} (task {mine.task}) does not read "
                     f"{', '.join(changed)}: the value would be ignored. Leave it out, or choose a "
                     f"variant that reads it (real data: qwen3_8b, qwen3_14b, real_smoke; the "
                     f"lessons world: lessons)")


def load_run_config(workdir: str) -> TrainConfig:
  """The config a training run was trained with (its workdir's config.json), typed. Fields added
  to the config file since the run was made take their variant's current default; fields it no
  longer has are dropped. Values are type-checked, not validated (its paths may be gone)."""
  return TrainConfig.from_dict(load_run_config_dict(workdir))


def load_run_config_dict(workdir: str) -> dict:
  """`load_run_config` as a nested dict (for a launcher that changes fields before typing it)."""
  if not os.path.isdir(workdir):
    raise FileNotFoundError(f"--workdir={workdir!r} does not exist")
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} not found: --workdir must be a training run directory "
                            f"(launch/train.py writes config.json there)")
  with open(path) as f:
    saved = json.load(f)
  base = task_config(saved.get("task") or "mhqa", saved.get("variant") or None).to_dict()
  return _overlay(base, saved)


def _overlay(base: dict, saved: dict) -> dict:
  out = {}
  for k, v in base.items():
    if isinstance(v, dict):
      out[k] = _overlay(v, saved.get(k) or {})
    else:
      out[k] = saved.get(k, v)
  return out
