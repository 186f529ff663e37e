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
sys.path.insert(0, os.path.join(ROOT, "configs"))

import mhqa  # noqa: E402

from trace_jax.assets import data_fingerprints, load_world_assets  # noqa: E402


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--cache", required=True)
  p.add_argument("--traces", type=int, default=2000)
  p.add_argument("--variant", default=None)
  a = p.parse_args()
  c = mhqa.get_config(a.variant)
  c.world.cache_dir = a.cache
  c = mhqa.validate(c)
  print(json.dumps(data_fingerprints(c, load_world_assets(c), a.traces), sort_keys=True))


if __name__ == "__main__":
  main()
