"""Trains an agent with TRACE (or a baseline) on multi-hop QA.

  python launch/train.py --config=configs/mhqa.py                 # embedded synthetic world, CPU
  python launch/train.py --config=configs/mhqa.py:smoke           # a few steps at toy size
  python launch/train.py --config=configs/mhqa.py --config.method=grpo --workdir=runs/grpo
  python launch/train.py --config=configs/mhqa.py:qwen3_14b --config.model.path=/ckpt/Qwen3-14B \
      --config.data.train_path=/data/train.parquet --config.data.test_path=/data/test.parquet \
      --config.retriever.url=http://127.0.0.1:8000

Exit status: 0 done; 75 stopped by SIGTERM/SIGINT after checkpointing its last step (rerun the
same command to resume); 70 stopped on divergence (the last good checkpoint is kept); 1 an error.
"""

import logging
import os
import sys

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

from absl import app, flags  # noqa: E402
from absl import logging as absl_logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

EXIT_PREEMPTED, EXIT_DIVERGED = 75, 70

_CONFIG = config_flags.DEFINE_config_file("config", os.path.join(_ROOT, "configs", "mhqa.py"),
                                          "configs/mhqa.py[:variant]")
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory (default: a new folder in runs/)")
_COMPILE_CACHE = flags.DEFINE_string(
    "compile_cache", os.path.join("cache", "xla"),
    "directory of XLA's persistent compilation cache (shared by every run on the machine, so only "
    "the first run of a shape compiles it); empty: off. JAX_COMPILATION_CACHE_DIR, when set, wins")


def main(argv, hooks=None):
  """Trains the config given by --config (translated and validated by `configs/convert.py`; a
  value the variant would not read is refused, `configs/runs.check_overrides`);
  `hooks` (`trace_jax.train.Hooks`) wrap the run's parts, for callers that run this main with
  their own instrumentation (tests/faults.py)."""
  del argv
  from configs import convert, runs
  from trace_jax.train import Diverged, Preempted, train, use_compile_cache

  logging.getLogger("bm25s").setLevel(logging.WARNING)
  absl_logging.set_verbosity(absl_logging.WARNING)  # checkpoint libraries log every save at INFO
  use_compile_cache(_COMPILE_CACHE.value)
  c = _CONFIG.value
  if _WORKDIR.value:
    c.workdir = _WORKDIR.value
  tc = convert.to_train_config(c)
  runs.check_overrides(c)  # a flag this variant would ignore is refused
  try:
    train(tc, hooks)
  except Preempted as e:
    print(f"[trace_jax] preempted: {e}", file=sys.stderr, flush=True)
    sys.exit(EXIT_PREEMPTED)
  except Diverged as e:
    print(f"[trace_jax] stopped: {e}", file=sys.stderr, flush=True)
    sys.exit(EXIT_DIVERGED)


if __name__ == "__main__":
  app.run(main)
