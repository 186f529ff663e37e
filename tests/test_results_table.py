"""`seed_stats` (Welch's comparison over seeds) and `projects/mhqa/results_table.py` (arms from
several compare summaries in one table)."""

import gzip
import importlib.util
import json
import os
import shlex
import subprocess
import sys

import numpy as np
import pytest

from launch.seed_stats import fmt, fmt_welch, is_finite, mean, mean_of, stats, wasted_ratio, welch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "results_table", os.path.join(ROOT, "projects", "mhqa", "results_table.py"))
rt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rt)


def test_welch_by_hand():
  # a: mean 2, var 1; b: mean 1/3, var 1/3. se² = 1/3 + 1/9 = 4/9; t = (5/3) / (2/3) = 2.5;
  # df = (4/9)² / ((1/3)² / 2 + (1/9)² / 2) = 3.2
  w = welch([1, 2, 3], [0, 0, 1])
  assert w["diff"] == pytest.approx(5 / 3) and w["se"] == pytest.approx(2 / 3)
  assert w["t"] == pytest.approx(2.5) and w["df"] == pytest.approx(3.2) and w["n"] == [3, 3]
  # two-sided p of t at df: the reference implementation's unequal-variance t test
  scipy_stats = pytest.importorskip("scipy.stats")
  ref = scipy_stats.ttest_ind([1, 2, 3], [0, 0, 1], equal_var=False)
  assert w["p"] == pytest.approx(float(ref.pvalue)) and w["t"] == pytest.approx(ref.statistic)
  assert welch([2, 1, None, float("nan")], [0, 1])["n"] == [2, 2]  # missing values dropped
  assert welch([1.0], [0.0, 1.0]) is None  # one seed: no spread to compare with
  assert welch([1.0, 1.0], [0.0, 0.0]) is None  # no spread on either side
  assert welch([3, 1, 2], [0, 1, 0])["t"] == pytest.approx(-welch([0, 1, 0], [3, 1, 2])["t"])


def test_stats_and_cells():
  s = stats([0.2, 0.4, None, True])  # a bool is not a measurement
  assert s == dict(mean=pytest.approx(0.3), std=pytest.approx(np.std([0.2, 0.4], ddof=1)),
                   min=0.2, max=0.4, n=2)
  assert stats([]) is None and stats([0.5])["std"] == 0.0
  assert fmt(s) == "0.300 ± 0.141" and fmt(stats([0.5])) == "0.500" and fmt(None) == "-"
  assert fmt(0.05) == "+0.050"
  assert fmt_welch(welch([1, 2, 3], [0, 0, 1])) == "+1.667 (t 2.5, df 3.2, p 0.082)"
  assert fmt_welch(None) == "-"
  # numpy scalars are numbers too (a bool is not)
  assert stats(np.arange(3))["mean"] == 1.0 and stats([np.bool_(True)]) is None
  assert welch(np.array([1, 2, 3], np.float32), [0, 0, 1])["t"] == pytest.approx(2.5)
  # `mean` filters the same way: what compare and trap_discovery average per-step records with
  assert mean([0.2, None, float("nan"), 0.4, False, np.float32(0.6)]) == pytest.approx(0.4)
  assert mean([None, float("nan")]) is None and mean([]) is None
  assert is_finite(1) and is_finite(np.float32(0.5)) and is_finite(-2.5)
  assert not any(is_finite(v) for v in (None, True, np.bool_(False), float("nan"),
                                        float("inf"), np.float64(-np.inf), "0.5", [0.5]))
  recs = [{"x": 0.2}, {"y": 1.0}, {"x": None}, {"x": 0.6}]  # records without the key are left out
  assert mean_of(recs, "x") == pytest.approx(0.4) and mean_of(recs, "z") is None


def _summary(d, method, seeds):
  """A compare.py output directory: summary.json runs and archived records with an EM curve."""
  runs = []
  for seed, ems in seeds:
    name = f"default/rollouts/{method}-seed{seed}"
    (d / "runs" / name).mkdir(parents=True)
    recs = [{"step": 2 * i, "eval_em": em} for i, em in enumerate(ems)]
    with gzip.open(d / "runs" / name / "metrics.jsonl.gz", "wt") as f:
      f.write("\n".join(json.dumps(r) for r in recs) + "\n")
    runs.append(dict(method=method, seed=seed, regime="default", budget="rollouts", run=name,
                     accuracy_final=ems[-1], em_curve_mean=float(np.mean(ems[1:])),
                     effective_ratio=0.5, mixed_groups=8.0, generated_tokens=90000,
                     slice_auc=None, em_half_gain_step=4, sampled_trap_share=0.5))
  runs.append(dict(runs[0], regime="low_contrast"))  # another regime: not read
  (d / "summary.json").write_text(json.dumps({"runs": runs}))


def test_arms_from_two_summaries(tmp_path):
  _summary(tmp_path / "a", "grpo", [(0, [0.2, 0.2, 0.3]), (1, [0.2, 0.22, 0.3]),
                                    (2, [0.2, 0.24, 0.3])])
  _summary(tmp_path / "b", "trace_tree", [(0, [0.2, 0.3, 0.3]), (1, [0.2, 0.32, 0.34])])
  arms = [rt.load_arm(rt.parse_arm(f"{tmp_path / 'a'}:grpo:base")),
          rt.load_arm(rt.parse_arm(f"{tmp_path / 'b'}:trace_tree:hard: 8 slots"))]
  assert arms[1]["label"] == "hard: 8 slots" and len(arms[0]["runs"]) == 3
  rows = rt.summarize(arms, "base", [2, 4])
  base, hard = rows
  assert "vs_reference" not in base
  assert base["em_at_step"][2]["mean"] == pytest.approx(0.22)
  assert hard["vs_reference"]["em_step2"]["diff"] == pytest.approx(0.31 - 0.22)
  assert hard["vs_reference"]["em_curve_mean"]["n"] == [2, 3]
  # grpo has no spread at step 4: the standard error is trace_tree's alone, std 0.028 over 2
  assert hard["vs_reference"]["em_step4"]["se"] == pytest.approx(0.02)
  md = rt.markdown(rows, "base", [2, 4])
  assert md.splitlines()[3].startswith("| hard: 8 slots | 2 | 0.310 ± 0.014 | 0.320 ± 0.028 |")
  # wasted groups as a share of the reference's (both arms at ER 0.5 here): 1, and none for the
  # reference itself
  assert hard["wasted_vs_reference"] == pytest.approx(1.0) and "wasted_vs_reference" not in base
  assert "1 − ER / base's" in md.splitlines()[0]
  assert "| 0.500 ± 0.000 | 1.00 | 8.0 ± 0.0 |" in md.splitlines()[3]
  assert "| 0.500 ± 0.000 | - | 8.0 ± 0.0 |" in md.splitlines()[2]
  assert wasted_ratio(0.75, 0.5) == pytest.approx(0.5)  # the target
  assert wasted_ratio(None, 0.5) is None
  assert wasted_ratio(0.75, 1.0) is None  # nothing wasted to compare
  with pytest.raises(ValueError, match="none of the arms"):
    rt.summarize(arms, "grpo", [2])
  with pytest.raises(ValueError, match="must differ"):
    rt.summarize([arms[0], dict(arms[1], label="base")], "base", [2])
  # a run without archived records: the seeds column counts it, the EM cells say how many they have
  os.remove(tmp_path / "b" / "runs" / "default/rollouts/trace_tree-seed1" / "metrics.jsonl.gz")
  arms[1] = rt.load_arm(rt.parse_arm(f"{tmp_path / 'b'}:trace_tree:a | b"))
  md = rt.markdown(rt.summarize(arms, "base", [2]), "base", [2])
  assert "| a \\| b | 2 | 0.300 (n=1) | 0.315 ± 0.021 |" in md
  with pytest.raises(ValueError, match="DIR:METHOD:LABEL"):
    rt.parse_arm("results/x:grpo")
  with pytest.raises(ValueError, match="no dapo run"):
    rt.load_arm(rt.parse_arm(f"{tmp_path / 'a'}:dapo:d"))


def test_script(tmp_path):
  _summary(tmp_path / "a", "grpo", [(0, [0.2, 0.2]), (1, [0.2, 0.3])])
  _summary(tmp_path / "b", "trace_tree", [(0, [0.2, 0.3]), (1, [0.2, 0.35])])
  out = tmp_path / "res" / "table"
  p = subprocess.run([sys.executable, "projects/mhqa/results_table.py",
                      f"--arm={tmp_path / 'a'}:grpo:grpo",
                      f"--arm={tmp_path / 'b'}:trace_tree:trace tree's (x)", "--eval_steps=2",
                      f"--table_out={out}"], cwd=ROOT, stdout=subprocess.PIPE,
                     stderr=subprocess.STDOUT, text=True, timeout=120)
  assert p.returncode == 0, p.stdout[-2000:]
  res = json.loads((tmp_path / "res" / "table.json").read_text())
  assert [a["label"] for a in res["arms"]] == ["grpo", "trace tree's (x)"]
  # the recorded command is a shell line that gives back the same arguments
  args = shlex.split(res["command"])
  assert args[:2] == ["python", "projects/mhqa/results_table.py"]
  assert f"--arm={tmp_path / 'b'}:trace_tree:trace tree's (x)" in args
  assert res["arms"][1]["vs_reference"]["em_step2"]["diff"] == pytest.approx(0.075)
  md = (tmp_path / "res" / "table.md").read_text()
  assert md.startswith(f"Command:\n\n```sh\n{res['command']}\n```\n")
  assert "| trace tree's (x) | 2 | 0.325 ± 0.035 |" in md
  assert os.path.getsize(str(out) + ".png") > 0
