"""Prints (JSON) the fingerprints of what a synthetic run is built from: world, expert traces,
packed warm-start rows (`trace_jax.warm_start.data_fingerprints`).

  python tests/scripts/data_fingerprints.py --cache /tmp/fp --traces 2000 [--variant lessons]

Run by tests/test_provenance.py twice, once with numpy's vector code paths switched off
(NPY_DISABLE_CPU_FEATURES): on a machine where they differ, the data must not.
"""

import argparse
import json

from configs import fc, mhqa, tool_math

from trace_jax import tasks
from trace_jax.warm_start import data_fingerprints  # noqa: E402


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--cache", required=True)
  p.add_argument("--traces", type=int, default=2000)
  p.add_argument("--variant", default=None)
  p.add_argument("--task", default="mhqa", choices=("mhqa", "math", "fc"))
  a = p.parse_args()
  c = {"math": tool_math, "fc": fc}.get(a.task, mhqa).get_config(a.variant)
  c.world.cache_dir = a.cache
  c = mhqa.validate(c)
  print(json.dumps(data_fingerprints(c, tasks.get(c.task).load(c), a.traces), sort_keys=True))


if __name__ == "__main__":
  main()
