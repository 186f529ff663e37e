"""Test-wide setup: test helper modules in tests/ import from subfolders (tests/reliability/), and
one persistent compilation cache for every process of the suite.

The suite runs on two workers with `--dist loadfile` (pyproject.toml's addopts): a file's tests go
to one worker, so a module-scoped fixture (a two-process pair, the real-path run) is built once.
The one smoke run that several files read is trained once per session across workers
(`test_train_smoke.smoke_run`).
"""

import os
import tempfile

# The campaign tools (launch/campaign.py, launch/seed_stats.py) are scripts' modules, not library.

# One persistent compilation cache for the tests' own processes, both workers and the runs they
# launch (tests/test_train_smoke.launch_env): a program compiled by one test is loaded, not
# compiled again, by the next test that builds the same one. Set before jax is imported.
COMPILE_CACHE = os.path.join(tempfile.gettempdir(), f"trace_jax_test_jit_cache_{os.getuid()}")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", COMPILE_CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")


def xla_flags(devices: int) -> str:
  """XLA_FLAGS of a launched process with `devices` simulated CPU devices (any flags the suite
  was started with kept)."""
  return (f"{os.environ.get('XLA_FLAGS', '')} "
          f"--xla_force_host_platform_device_count={devices}").strip()


# The heaviest files first (measured on 2 cores), so the two workers finish together: the
# scheduler hands out files in collection order (`--no-loadscope-reorder`), two queued per worker.
# The file that trains the shared smoke run comes before the files that read it.
HEAVY_FIRST = ("test_real_path.py", "test_multiprocess_train.py", "test_train_smoke.py",
               "test_notebooks.py", "test_resume.py",
               "test_update_sharded.py", "test_compare.py", "test_eval_launch.py",
               "test_sampler_sharded.py", "test_plan.py", "test_update.py", "test_qwen3_model.py",
               "test_parallel.py")


def pytest_collection_modifyitems(config, items):
  rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
  items.sort(key=lambda item: rank.get(os.path.basename(str(item.path)), len(rank)))
