"""`projects/mhqa/trap_discovery.py`: early trap-hop rollouts of archived runs against learning
speed."""

import gzip
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from launch.seed_stats import spearman, spearman_test

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "trap_discovery", os.path.join(ROOT, "projects", "mhqa", "trap_discovery.py"))
td = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(td)


def step(k, trap_share, reward_trap, leaves=128, pool=0.5):
  return dict(step=k, rollouts_trap_share=trap_share, reward_trap=reward_trap, leaves=leaves,
              sampled_trap_share=trap_share, pool_trap_share=pool)


def test_early_trap_stats_reads_only_the_first_steps():
  recs = [{"step": -1, "sft_nll": 1.0}, {"step": 0, "eval_em": 0.2}, step(1, 0.5, 0.02),
          step(2, 0.25, 0.0), step(3, 1.0, 1.0, pool=0.8)]
  out = td.early_trap_stats(recs, first_steps=2)
  assert out["steps"] == 2
  assert out["trap_rollouts_per_step"] == pytest.approx((64 + 32) / 2)
  assert out["trap_successes_per_step"] == pytest.approx(64 * 0.02 / 2)
  assert td.early_trap_stats([{"step": 1, "effective_ratio": 0.5}], 4) is None
  assert out["run_pool_trap_share"] == pytest.approx(1.8 / 3)  # every step, not the first two
  assert out["final_slice_calib"] == []  # no step logs the reliability bins


def test_final_slice_calib_takes_the_last_logged_bins():
  def bins(step, n0):
    return {"step": step, "slice_calib0_n": n0, "slice_calib0_pred": 0.1,
            "slice_calib0_outcome": 0.2, "slice_calib3_n": 4, "slice_calib3_pred": 0.9,
            "slice_calib3_outcome": 0.5}
  recs = [bins(1, 2), bins(2, 0), {"step": 2, "eval_em": 0.3}]
  assert td.final_slice_calib(recs) == [dict(n=4, pred=0.9, outcome=0.5)]  # empty bin 0 dropped
  assert td.final_slice_calib(recs[:1])[0] == dict(n=2, pred=0.1, outcome=0.2)


def test_spearman():
  assert spearman([1, 2, 3, 4], [10, 20, 30, 45]) == pytest.approx(1.0)
  assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
  assert spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(0.866, abs=1e-3)  # a tie
  assert spearman([1, 2], [1, 2]) is None and spearman([1, 1, 1], [1, 2, 3]) is None
  with pytest.raises(ValueError, match="3 against 2"):
    spearman([1, 2, 3], [1, 2])
  # Beyond 8 pairs the p is the t approximation, as scipy's own (no ties).
  from scipy import stats as st
  x = [0.1, 0.5, 0.3, 0.9, 0.7, 0.2, 0.4, 0.8, 0.05, 0.6]
  y = [1.0, 2.5, 2.0, 2.2, 3.0, 0.5, 1.1, 1.9, 0.7, 0.2]
  ref = st.spearmanr(x, y)
  got = spearman_test(x, y)
  assert got["rho"] == pytest.approx(ref.statistic) and got["p"] == pytest.approx(ref.pvalue)
  assert got["n"] == 10 and got["df"] == 8
  # Residuals from 3 group means: 3 fewer degrees of freedom, a larger p for the same rho.
  fewer = spearman_test(x, y, fitted=3)
  assert fewer["df"] == 5 and fewer["p"] > got["p"] and fewer["rho"] == got["rho"]
  assert spearman_test(x[:9], y[:9], fitted=7) is None  # no degree of freedom left
  # Up to 8 pairs the p is exact: a perfect order of 3 is 2 of the 6 orderings (|rho| = 1).
  assert spearman_test([1, 2, 3], [3, 2, 1])["p"] == pytest.approx(2 / 6)
  assert spearman_test([1, 2, 3, 4], [1, 2, 3, 4])["p"] == pytest.approx(2 / 24)
  small = spearman_test(x[:7], y[:7])
  assert small["df"] is None and small["rho"] == pytest.approx(st.spearmanr(x[:7], y[:7]).statistic)
  rng = np.random.default_rng(0)  # the exact p against a Monte Carlo estimate of it
  rx = np.argsort(np.argsort(x[:7]))
  sims = [abs(spearman(rx, rng.permutation(7))) >= abs(small["rho"]) - 1e-9 for _ in range(4000)]
  assert small["p"] == pytest.approx(np.mean(sims), abs=0.03)
  assert spearman_test([1, 2], [2, 1]) is None


def test_script_on_an_archive(tmp_path):
  """Three archived runs: the more trap rollouts early, the sooner half the gain; a run that
  predates the logging is skipped."""
  runs = []
  for seed, share, half in ((0, 0.3, 12), (1, 0.5, 8), (2, 0.6, 6), (3, None, 10)):
    name = f"default/rollouts/trace_tree-seed{seed}"
    d = tmp_path / "cmp" / "runs" / name
    d.mkdir(parents=True)
    recs = [{"step": k, "effective_ratio": 0.5} if share is None else step(k, share, 0.05)
            for k in range(1, 6)]
    with gzip.open(d / "metrics.jsonl.gz", "wt") as f:
      f.write("\n".join(json.dumps(r) for r in recs) + "\n")
    runs.append(dict(method="trace_tree", seed=seed, run=name, em_half_gain_step=half,
                     sampled_trap_share=None if share is None else share + 0.01))
  # A run listed under a second budget mode (as grpo's and dapo's are) is read once.
  runs.append(dict(runs[0], budget="tokens"))
  (tmp_path / "cmp" / "summary.json").write_text(json.dumps({"runs": runs}))
  out = tmp_path / "res" / "td"
  p = subprocess.run([sys.executable, "projects/mhqa/trap_discovery.py",
                      f"--summaries={tmp_path / 'cmp'}", f"--out={out}"], cwd=ROOT,
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
  assert p.returncode == 0, p.stdout[-2000:]
  res = json.loads((tmp_path / "res" / "td.json").read_text())
  assert [r["seed"] for r in res["runs"]] == [0, 1, 2]
  assert res["runs"][0]["run"] == "default/rollouts/trace_tree-seed0"
  # the run-long sampled trap share is compare.py's, carried from the summary
  assert [r["run_sampled_trap_share"] for r in res["runs"]] == \
      pytest.approx([0.31, 0.51, 0.61])  # not the records' 0.3, 0.5, 0.6
  assert res["spearman_with_half_gain_step"]["trap_rollouts_per_step"] == pytest.approx(-1.0)
  assert os.path.getsize(str(out) + ".png") > 0
