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



def _config_module(name):
  """configs/<name>.py, loaded by path (a module named `math` must not shadow the standard
  library's)."""
  spec = importlib.util.spec_from_file_location(f"{name}_config",
                                                os.path.join(ROOT, "configs", f"{name}.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


math_config, fc_config = _config_module("math"), _config_module("fc")

from trace_jax.assets import data_fingerprints, load_assets  # noqa: E402


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--cache", required=True)
  p.add_argument("--traces", type=int, default=2000)
  p.add_argument("--variant", default=None)
  p.add_argument("--task", default="mhqa", choices=("mhqa", "math", "fc"))
  a = p.parse_args()
  c = {"math": math_config, "fc": fc_config}.get(a.task, mhqa).get_config(a.variant)
  c.world.cache_dir = a.cache
  c = mhqa.validate(c)
  print(json.dumps(data_fingerprints(c, load_assets(c), a.traces), sort_keys=True))


if __name__ == "__main__":
  main()
