"""Moves a series' runs that finished from a lost warm start out of it, so they are rerun.

After a move to another machine the cached warm start is lost and rebuilt, and on worlds 20-21
the rebuilt one had other parameters (`params_sha1`); then a world whose arms finished partly
before the move and partly after holds arms from two warm starts, which are not a paired comparison
(`README.md`, the many-worlds series' "Failures" rule). For one cell (`w{world}-ws{warm}`) and one
RL seed this keeps the runs from the warm start of the newest finished run (the one cached on this
machine: every run here after the move used it) and moves the others' archived copies, workdirs
and summary rows to `--dest/{cell}-warm-{sha}/{arm}/`; `launch/compare.py` then sees them
unfinished and reruns them from the cached warm start.

  python projects/lessons/supersede.py --cell projects/lessons/results/worlds/w20-ws0 \
      --runs runs/lessons_worlds/w20-ws0 --seed 0 --dest projects/lessons/results/worlds_superseded

Exit status 0: nothing to move; 3: runs moved (rerun the arms); other: an error.
"""

import argparse
import glob
import os
import shutil
import sys

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")

from launch.campaign import archive_dir, read_summary, write_summary  # noqa: E402

MOVED = 3


def _rows(cell: str, seed: int) -> list[tuple[str, dict, float]]:
  """(arm folder, summary row, its archived run's mtime) for every row of `seed` in the cell."""
  out = []
  for path in sorted(glob.glob(os.path.join(cell, "*", "summary.json"))):
    arm_dir = os.path.dirname(path)
    for row in read_summary(arm_dir)["runs"]:
      if row.get("seed") != seed:
        continue
      archived = os.path.join(archive_dir(arm_dir, row["run"]), "summary.json")
      out.append((arm_dir, row, os.path.getmtime(archived) if os.path.exists(archived) else 0.0))
  return out


def stale_runs(cell: str, seed: int) -> list[tuple[str, dict]]:
  """(arm folder, row) of the runs of `seed` in the cell whose warm start (`warm_start_sha1`) is
  not that of the newest finished run; empty when the seed's runs share one warm start."""
  rows = _rows(cell, seed)
  if len({r["warm_start_sha1"] for _, r, _ in rows}) < 2:
    return []
  keep = max(rows, key=lambda x: x[2])[1]["warm_start_sha1"]
  stale = {(d, r["run"]): (d, r) for d, r, _ in rows if r["warm_start_sha1"] != keep}
  return list(stale.values())  # one entry a run (a run may hold a row per budget)


def supersede(arm_dir: str, row: dict, runs_dir: str, dest: str) -> str:
  """Moves one run out of its arm: its archived copy and workdir (if any) to `dest`, its rows
  (every budget of the run) from the arm's summary.json to `dest`'s. Returns the destination."""
  arm, run = os.path.basename(arm_dir), row["run"]
  cell = os.path.basename(os.path.dirname(arm_dir))
  to = os.path.join(dest, f"{cell}-warm-{row['warm_start_sha1']}", arm)
  for src, dst in ((archive_dir(arm_dir, run), archive_dir(to, run)),
                   (os.path.join(runs_dir, arm, run), os.path.join(to, "workdirs", run))):
    if os.path.exists(src):
      os.makedirs(os.path.dirname(dst), exist_ok=True)
      shutil.move(src, dst)
  summary = read_summary(arm_dir)
  moved = [r for r in summary["runs"] if r["run"] == run]
  summary["runs"] = [r for r in summary["runs"] if r["run"] != run]
  old = read_summary(to, missing_ok=True) or dict(runs=[], superseded_from=arm_dir)
  old["runs"] += moved
  write_summary(to, old)
  write_summary(arm_dir, summary)
  return to


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--cell", required=True, help="a series cell, e.g. results/worlds/w20-ws0")
  p.add_argument("--runs", required=True, help="the cell's run workdirs (compare.py --runs)")
  p.add_argument("--seed", type=int, required=True, help="the RL seed whose runs are paired")
  p.add_argument("--dest", required=True, help="where superseded runs go")
  a = p.parse_args(argv)
  stale = stale_runs(a.cell, a.seed)
  for arm_dir, row in stale:
    to = supersede(arm_dir, row, a.runs, a.dest)
    print(f"superseded {os.path.basename(a.cell)}/{os.path.basename(arm_dir)}/{row['run']} "
          f"(warm start {row['warm_start_sha1']}, not the newest run's) -> {to}", flush=True)
  return MOVED if stale else 0


if __name__ == "__main__":
  sys.exit(main())
