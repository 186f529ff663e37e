"""`projects/mhqa/repro_check.py`: a rerun of a campaign's runs compared with the archived
records."""

import gzip
import json
import os
import subprocess
import sys

import pytest

from projects.mhqa import repro_check

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _campaign(d, runs):
  """A compare.py output dir: {run name: (summary row fields, per-step records)}."""
  rows = []
  for name, (row, recs) in runs.items():
    (d / "runs" / name).mkdir(parents=True)
    with gzip.open(d / "runs" / name / "metrics.jsonl.gz", "wt") as f:
      f.write("".join(json.dumps(r) + "\n" for r in recs))
    rows.append(dict(run=name, budget="rollouts", **row))
  (d / "summary.json").write_text(json.dumps({"runs": rows}))
  return str(d)


RECS = [{"step": 0, "eval_em": 0.2}, {"step": 1, "loss": 0.5, "sample_seconds": 3.0},
        {"step": 2, "loss": 0.4, "entropy": 1.0}, {"step": 2, "eval_em": 0.3}]
ROW = dict(accuracy_final=0.3, effective_ratio=0.7, generated_tokens=1000)


def test_identical_runs_and_wall_clock_left_out(tmp_path):
  ref = _campaign(tmp_path / "a", {"r/grpo-seed0": (ROW, RECS)})
  faster = [dict(r, sample_seconds=1.0) if "sample_seconds" in r else r for r in RECS]
  new = _campaign(tmp_path / "b", {"r/grpo-seed0": (ROW, faster)})
  (row,) = repro_check.check(ref, new)
  assert row["identical"] and row["steps_compared"] == 3 and row["differ"] == {}
  assert row["keys_compared"] == 4  # step, eval_em, loss, entropy: sample_seconds is left out


def test_differences_named_with_their_size(tmp_path):
  ref = _campaign(tmp_path / "a", {"r/x-seed0": (ROW, RECS), "r/only-ref": (ROW, RECS)})
  changed = [dict(r) for r in RECS]
  changed[2]["loss"] = 0.45           # a number moved
  changed[3]["eval_em"] = float("nan")  # a number lost
  changed[1]["new_metric"] = 1.0      # a metric the later commit adds: listed, not a difference
  new = _campaign(tmp_path / "b", {"r/x-seed0": (dict(ROW, accuracy_final=0.31), changed)})
  (row,) = repro_check.check(ref, new)  # only the run both hold
  assert not row["identical"]
  assert row["differ"]["loss"] == pytest.approx(0.05) and row["differ"]["eval_em"] == float("inf")
  assert row["keys_only_rerun"] == ["new_metric"] and row["keys_only_reference"] == []
  assert row["summary_differ"] == {"accuracy_final": pytest.approx(0.01)}
  assert "2 keys differ" in repro_check.markdown([row])
  # a missing step is not identical either
  short = _campaign(tmp_path / "c", {"r/x-seed0": (ROW, RECS[:2])})
  (row,) = repro_check.check(ref, short)
  assert row["steps_only_reference"] == [2] and not row["identical"]


def test_script(tmp_path):
  ref = _campaign(tmp_path / "a", {"r/grpo-seed0": (ROW, RECS)})
  new = _campaign(tmp_path / "b", {"r/grpo-seed0": (ROW, RECS)})
  out = tmp_path / "o" / "repro"
  subprocess.run([sys.executable, "projects/mhqa/repro_check.py", f"--reference={ref}",
                  f"--rerun={new}",
                  f"--out={out}"], cwd=ROOT, check=True, capture_output=True)
  data = json.loads((tmp_path / "o" / "repro.json").read_text())
  assert data["runs"][0]["identical"] and "projects/mhqa/repro_check.py" in data["command"]
  assert "| identical |" in (tmp_path / "o" / "repro.md").read_text()
  # no run in common: a clear error, not an empty table
  other = _campaign(tmp_path / "c", {"r/dapo-seed0": (ROW, RECS)})
  p = subprocess.run([sys.executable, "projects/mhqa/repro_check.py", f"--reference={ref}",
                      f"--rerun={other}", f"--out={out}"], cwd=ROOT, capture_output=True, text=True)
  assert p.returncode != 0 and "no run of" in p.stderr
