"""Prints (JSON) the fingerprints of what a synthetic run is built from: world, expert traces,
packed warm-start rows (`trace_jax.assets.data_fingerprints`).

  python tests/scripts/data_fingerprints.py --cache /tmp/fp --traces 2000 [--variant lessons]

Run by tests/test_provenance.py twice, once with numpy's vector code paths switched off
(NPY_DISABLE_CPU_FEATURES): on a machine where they differ, the data must not.
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(os.path.join(ROOT, "configs"))

import importlib.util  # noqa: E402

import mhqa  # noqa: E402

# configs/math.py by path: a module named `math` must not shadow the standard library's.
_spec = importlib.util.spec_from_file_location("math_config", os.path.join(ROOT, "configs",
                                                                           "math.py"))
math_config = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(math_config)

from trace_jax.assets import data_fingerprints, load_assets  # noqa: E402


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--cache", required=True)
  p.add_argument("--traces", type=int, default=2000)
  p.add_argument("--variant", default=None)
  p.add_argument("--task", default="mhqa", choices=("mhqa", "math"))
  a = p.parse_args()
  c = (math_config if a.task == "math" else mhqa).get_config(a.variant)
  c.world.cache_dir = a.cache
  c = mhqa.validate(c)
  print(json.dumps(data_fingerprints(c, load_assets(c), a.traces), sort_keys=True))


if __name__ == "__main__":
  main()
