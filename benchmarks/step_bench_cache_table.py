"""Merges `step_bench_cache.sh`'s files: compilations and their seconds at setup and in the first
RL steps, per setting, on a cold and on a warm persistent compilation cache.

  python benchmarks/step_bench_cache_table.py [--dir results/step_bench_cache]

Writes results/step_bench_cache.json ({"runs": [{"setting", "pass", "setup_compiles",
"setup_compile_s", "compiles_by_step", "compile_s_by_step"}]}) and results/step_bench_cache.png.
"""

from __future__ import annotations

import argparse
import glob
import json
import os


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--dir", default="results/step_bench_cache")
  a = p.parse_args()
  rows = []
  for path in glob.glob(os.path.join(a.dir, "*-*.json")):
    setting, pas = os.path.basename(path)[:-5].rsplit("-", 1)
    for r in json.load(open(path))["runs"]:
      rows.append(dict(setting=setting, **{"pass": pas}, **{
          k: r.get(k) for k in ("setup_compiles", "setup_compile_s", "compiles_by_step",
                                "compile_s_by_step")}))
  rows.sort(key=lambda r: (r["setting"], r["pass"]))
  stem = a.dir.rstrip("/")
  with open(stem + ".json", "w") as f:
    json.dump(dict(command="bash benchmarks/step_bench_cache.sh", runs=rows), f, indent=1)
  for r in rows:
    print(f"{r['setting']:28s} {r['pass']}: setup {r['setup_compiles']} ({r['setup_compile_s']} s)"
          f", by step {r['compiles_by_step']} ({r['compile_s_by_step']} s)")

  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(8, 3.5))
  labels = [" ".join(r["setting"].split("_")) + "\n" + r["pass"] for r in rows]
  setup = [r["setup_compile_s"] for r in rows]
  steps = [sum(r["compile_s_by_step"][:2]) for r in rows]
  ax.bar(labels, setup, label="setup (build, warm-start probe)", color="tab:grey")
  ax.bar(labels, steps, bottom=setup, label="RL steps 0-1", color="tab:orange")
  ax.set(ylabel="compilation seconds")
  ax.tick_params(axis="x", labelsize=7, rotation=20)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(stem + ".png", dpi=110)


if __name__ == "__main__":
  main()
