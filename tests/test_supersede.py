"""projects/lessons/supersede.py: a series' runs from a lost warm start leave it, to be rerun."""

import json
import os

from launch.campaign import finished_summary, read_summary
from projects.lessons import supersede as sp

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _arm(cell, arm, method, shas, mtime):
  """An arm folder as compare.py leaves it: summary rows, one archived run per seed."""
  d = cell / arm
  rows = []
  for seed, sha in enumerate(shas):
    run = f"default/tokens/{method}-seed{seed}"
    (d / "runs" / run).mkdir(parents=True)
    (d / "runs" / run / "summary.json").write_text("{}")
    os.utime(d / "runs" / run / "summary.json", (mtime + seed, mtime + seed))
    rows.append(dict(run=run, seed=seed, method=method, budget="tokens", warm_start_sha1=sha))
  (d / "summary.json").write_text(json.dumps(dict(runs=rows, date="d")))
  return d


def test_runs_from_a_lost_warm_start_are_moved_out_and_seen_unfinished(tmp_path, capsys):
  cell = tmp_path / "worlds" / "w20-ws0"
  # seed 0: grpo and trace_paper finished from warm start "old" before a move, trace_binned
  # after it from the rebuilt "new" (newest); seed 1 all from "new"
  grpo = _arm(cell, "grpo", "grpo", ["old", "new"], 1000)
  paper = _arm(cell, "trace_paper", "trace_tree", ["old", "new"], 1100)
  binned = _arm(cell, "trace_binned", "trace_tree", ["new"], 5000)
  runs = tmp_path / "runs" / "w20-ws0"
  (runs / "grpo" / "default/tokens/grpo-seed0").mkdir(parents=True)  # a leftover workdir
  (runs / "grpo" / "default/tokens/grpo-seed0" / "summary.json").write_text("{}")
  stale = sp.stale_runs(str(cell), 0)
  assert sorted((os.path.basename(d), r["run"]) for d, r in stale) == [
      ("grpo", "default/tokens/grpo-seed0"), ("trace_paper", "default/tokens/trace_tree-seed0")]
  assert sp.stale_runs(str(cell), 1) == []  # seed 1's arms share a warm start
  dest = tmp_path / "superseded"
  args = [f"--cell={cell}", f"--runs={runs}", "--seed=0", f"--dest={dest}"]
  assert sp.main(args) == sp.MOVED
  out = capsys.readouterr().out
  assert out.count("superseded w20-ws0/") == 2 and "warm start old" in out
  for arm_dir, run in ((grpo, "default/tokens/grpo-seed0"),
                       (paper, "default/tokens/trace_tree-seed0")):
    arm = os.path.basename(arm_dir)
    # compare.py's test of a finished run now fails: it is rerun
    assert finished_summary(str(runs / arm), str(arm_dir / "runs"), run) is None
    assert [r["seed"] for r in read_summary(str(arm_dir))["runs"]] == [1]
    moved = dest / "w20-ws0-warm-old" / arm
    assert [r["run"] for r in read_summary(str(moved))["runs"]] == [run]
    assert (moved / "runs" / run / "summary.json").exists()
  assert (dest / "w20-ws0-warm-old" / "grpo" / "workdirs" / "default/tokens/grpo-seed0").is_dir()
  assert [r["seed"] for r in read_summary(str(binned))["runs"]] == [0]  # the kept run stays
  assert sp.main(args) == 0  # nothing left to move

