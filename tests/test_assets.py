"""The warm start's cache key covers everything that changes the warm start, the seed included."""

import os
import sys

from configs import mhqa, runs
from trace_jax import assets, tasks, warm_start
from trace_jax.assets import sft_seed
from trace_jax.config import TrainConfig
from trace_jax.fileio import build_lock
from trace_jax.warm_start import warm_start_key

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(**overrides) -> TrainConfig:
  """The smoke config with `section__field=value` overrides, typed (not validated)."""
  c = mhqa.get_config("smoke")
  for dotted, v in overrides.items():
    node = c
    *path, last = dotted.split("__")
    for k in path:
      node = node[k]
    node[last] = v
  return TrainConfig.from_dict(c.to_dict())


def test_the_run_seed_picks_the_warm_start_unless_sft_seed_is_set():
  assert sft_seed(_cfg(seed=3)) == 3
  assert sft_seed(_cfg(seed=3, sft__seed=0)) == 0
  assert warm_start_key(_cfg(seed=0)) != warm_start_key(_cfg(seed=1))
  # A fixed sft.seed shares one warm start across RL seeds, the same one as that run seed's own.
  assert warm_start_key(_cfg(seed=1, sft__seed=0)) == warm_start_key(_cfg(seed=0))
  assert warm_start_key(_cfg(seed=2, sft__seed=0)) == warm_start_key(_cfg(seed=1, sft__seed=0))


def test_rl_settings_do_not_touch_the_warm_start():
  base = warm_start_key(_cfg())
  assert warm_start_key(_cfg(method="grpo", rl__lr=1e-5, rollout__tree_lambda=0.5)) == base
  assert warm_start_key(_cfg(sft__steps=9)) != base


def test_train_hops_filters_training_questions_only():
  import pytest

  from trace_jax.assets import select_hops
  train = [dict(hops=h, meta={}) for h in (1, 2, 3, 4, 3)] + [dict(hops=None, meta={"hops": 4})]
  assert select_hops(_cfg(), train) == train  # '' keeps everything
  kept = select_hops(_cfg(data__train_hops="3,4"), train)
  assert [ex.get("hops") or ex["meta"]["hops"] for ex in kept] == [3, 4, 3, 4]
  with pytest.raises(ValueError, match="keeps none"):
    select_hops(_cfg(data__train_hops="7"), train)
  assert assets.parse_hops(" 4, 3,") == (3, 4)
  for bad in ("three", "0,1"):
    with pytest.raises(ValueError, match="train_hops"):
      assets.parse_hops(bad)
  # The warm start does not depend on the training mix.
  assert warm_start_key(_cfg(data__train_hops="3,4")) == warm_start_key(_cfg())


def test_test_questions_say_whether_their_entity_was_seen_in_training(tmp_path):
  """Each world test question carries `entity_seen`: its start entity is in some train question's
  chain (the names the expert traces write). Held-out EM is reported for both halves."""
  a = assets.load_world_assets(_cfg(world__cache_dir=str(tmp_path)))
  seen = {x for e in a.world.train for x in e.meta["chain"]}
  assert all(e["entity_seen"] == (e["meta"]["chain"][0] in seen) for e in a.test)
  assert 0 < sum(e["entity_seen"] for e in a.test) < len(a.test)  # both halves exist
  assert all("entity_seen" not in e for e in a.train)


def test_trap_rate_keys_its_own_world_and_warm_start(tmp_path):
  """`world.trap_rate` at the world's default keeps the caches of every earlier run (same world
  directory, same warm-start key); another rate gets its own world and warm start."""
  import pytest

  from trace_jax.assets import world_dir_name
  from trace_jax.envs.worlds.synthetic import SyntheticWorldConfig

  assert mhqa.DEFAULT_TRAP_RATE == SyntheticWorldConfig.trap_rate
  import json


  base = _cfg()
  saved = base.to_dict()
  del saved["world"]["trap_rate"]  # a run's config.json from before the option
  (tmp_path / "config.json").write_text(json.dumps(saved))
  legacy = runs.load_run_config(str(tmp_path))
  assert legacy == base and warm_start_key(base) == warm_start_key(legacy)
  assert world_dir_name(base) == world_dir_name(legacy) == "world-seed0"
  harder = _cfg(world__trap_rate=0.9)
  assert warm_start_key(harder) != warm_start_key(base)
  assert world_dir_name(harder) == "world-seed0-trap0.9"
  bad = _cfg(world__trap_rate=1.5)
  with pytest.raises(ValueError, match="trap_rate"):
    mhqa.validate(bad)


def test_forced_slots_fit_in_the_step():
  """The exploration and hard slots are places among prompts_per_step: more is refused."""
  import pytest

  n = _cfg().rollout.prompts_per_step
  assert n >= 2
  mhqa.validate(_cfg(rollout__explore_prompts=1, rollout__hard_prompts=n - 1))
  for bad in (_cfg(rollout__explore_prompts=1, rollout__hard_prompts=n),
              _cfg(rollout__hard_prompts=-1)):
    with pytest.raises(ValueError, match="hard_prompts"):
      mhqa.validate(bad)


def test_the_key_follows_the_data_content(monkeypatch, tmp_path):
  """A change to the expert's traces or the tokenizer's words (same config) misses the cache: a
  first version keyed on the config alone restored a warm start trained with another vocabulary
  after the function-calling expert's thoughts changed."""
  from trace_jax.envs.tasks import fc_world

  c = _cfg(task="fc", world__cache_dir=str(tmp_path))
  base = warm_start.warm_start_sample_sha1(c, tasks.get(c.task).load(c))
  assert base == warm_start.warm_start_sample_sha1(c, tasks.get(c.task).load(c))  # deterministic
  assert warm_start_key(c, base) != warm_start_key(c, "0" * 12)
  real = fc_world._plan

  def other_thoughts(template, state, params, mistake):
    return [("look " + t, call) for t, call in real(template, state, params, mistake)]

  monkeypatch.setattr(fc_world, "_plan", other_thoughts)
  assert warm_start.warm_start_sample_sha1(c, tasks.get(c.task).load(c)) != base


def test_build_lock_excludes_another_process_until_released(tmp_path):
  """The warm start's build lock: while one process holds it, another cannot take it (so two
  runs never train the same cached warm start at once); once released, it can."""
  import subprocess

  path = str(tmp_path / "cache" / "warmstart-x.lock")
  probe = ("import fcntl, sys\n"
           "f = open(sys.argv[1], 'a')\n"
           "try:\n  fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\n  print('free')\n"
           "except BlockingIOError:\n  print('held')\n")
  take = lambda: subprocess.run([sys.executable, "-c", probe, path], capture_output=True,
                                text=True, check=True).stdout.strip()
  with build_lock(path):
    assert take() == "held"
  assert take() == "free"
