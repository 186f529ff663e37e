"""projects/lessons/power.py: the variance components and the design arithmetic."""

import gzip
import json
import math

import numpy as np
import pytest

from projects.lessons import power


def _simulate(rng, worlds, seeds, sigma, tau, gain, warm_starts=1):
  runs = []
  for w in range(worlds):
    delta = gain + tau * rng.standard_normal()
    for ws in range(warm_starts):
      base = 0.6 + 0.05 * rng.standard_normal()
      for arm, shift in (("grpo", 0.0), ("trace_paper", delta)):
        for k in range(seeds):
          runs.append(dict(arm=arm, world_seed=w, warm_start_seed=ws, seed=k,
                           em_at_equal_tokens=base + shift + sigma * rng.standard_normal(),
                           wall_seconds=600.0, steps=100))
  return runs


def test_components_recover_the_simulated_spreads():
  rng = np.random.default_rng(0)
  runs = _simulate(rng, worlds=600, seeds=4, sigma=0.02, tau=0.01, gain=0.012)
  comps = power.variance_components(power.cells_of(runs, "trace_paper", "grpo"),
                                    "trace_paper", "grpo")
  assert comps["cells"] == 600 and comps["worlds"] == 600
  assert comps["sigma"] == pytest.approx(0.02, rel=0.05)
  assert comps["tau"] == pytest.approx(0.01, rel=0.2)
  assert comps["tau_upper90"] > comps["tau"]
  assert comps["mean_diff"] == pytest.approx(0.012, abs=0.003)


def test_tau_is_zero_when_cells_differ_by_sampling_alone():
  rng = np.random.default_rng(1)
  runs = _simulate(rng, worlds=400, seeds=3, sigma=0.02, tau=0.0, gain=0.0)
  comps = power.variance_components(power.cells_of(runs, "trace_paper", "grpo"),
                                    "trace_paper", "grpo")
  assert comps["tau"] < 0.004


def test_design_se_matches_the_spread_of_the_pooled_estimate():
  rng = np.random.default_rng(2)
  sigma, tau, w, c, n = 0.02, 0.01, 4, 2, 3
  est = []
  for _ in range(3000):
    runs = _simulate(rng, worlds=w, seeds=n, sigma=sigma, tau=tau, gain=0.0, warm_starts=c)
    cells = power.cells_of(runs, "trace_paper", "grpo")
    per_world = {}
    for (world, _), v in cells.items():
      per_world.setdefault(world, []).append(np.mean(v["trace_paper"]) - np.mean(v["grpo"]))
    est.append(np.mean([np.mean(x) for x in per_world.values()]))
  assert np.std(est) == pytest.approx(power.design_se(sigma, tau, w, c, n), rel=0.05)


def test_design_table_and_cheapest():
  rows = power.design_table(0.02, {"0": 0.0}, gain=0.01, core_hours_per_run=0.25,
                            core_hours_per_warm_start=0.5, designs=[(1, 1, 1), (4, 1, 2)])
  assert rows[0]["runs"] == 2 and rows[0]["core_hours"] == pytest.approx(1.0)
  assert rows[1]["runs"] == 16 and rows[1]["core_hours"] == pytest.approx(6.0)
  se = 0.02 * math.sqrt(2 / 2 / 4)
  assert rows[1]["se_0"] == pytest.approx(se)
  assert rows[1]["detectable_0"] == pytest.approx(2.801585 * se, rel=1e-4)
  assert power.cheapest(rows, 0.03, "0") is rows[1]
  assert power.cheapest(rows, 0.001, "0") is None
  with pytest.raises(ValueError, match="design needs"):
    power.design_se(0.02, 0.0, 0, 1, 1)


def test_cells_need_both_arms_and_two_cells():
  runs = [dict(arm="grpo", world_seed=0, warm_start_seed=0, em_at_equal_tokens=0.5),
          dict(arm="trace_paper", world_seed=1, warm_start_seed=0, em_at_equal_tokens=0.5)]
  assert power.cells_of(runs, "trace_paper", "grpo") == {}
  with pytest.raises(ValueError, match="at least 2 cells"):
    power.variance_components({}, "trace_paper", "grpo")


def test_main_writes_its_files(tmp_path):
  rng = np.random.default_rng(3)
  runs = _simulate(rng, worlds=5, seeds=3, sigma=0.02, tau=0.01, gain=0.01)
  arms = tmp_path / "pilot"
  (arms / "lessons").mkdir(parents=True)
  (arms / "lessons" / "summary.json").write_text(json.dumps(dict(runs=runs)))
  arm_dir = arms / "w0-ws0" / "grpo"
  run_dir = arm_dir / "runs" / "default" / "rollouts" / "grpo-seed0"
  run_dir.mkdir(parents=True)
  (arm_dir / "summary.json").write_text(json.dumps(dict(runs=[
      dict(run="default/rollouts/grpo-seed0"), dict(run="default/rollouts/grpo-seed1")])))
  with gzip.open(run_dir / "metrics.jsonl.gz", "wt") as f:
    f.write(json.dumps({"step": -1, "sft_seconds": 100.0}) + "\n")
    f.write(json.dumps({"step": -1, "sft_seconds": 720.0}) + "\n")
    f.write(json.dumps({"step": 0, "eval_em": 0.3}) + "\n")
  assert power.warm_start_seconds(str(arms)) == [720.0]
  out = tmp_path / "out"
  power.main(["--summary", str(arms / "lessons" / "summary.json"), "--out", str(out)])
  result = json.loads((out / "power.json").read_text())
  assert result["core_hours_per_warm_start"] == pytest.approx(0.2)
  assert result["core_hours_per_run"] == pytest.approx(600 / 3600)
  assert result["preregistered_design"]["runs"] == 20
  assert len(result["designs"]) == len(power.DESIGNS)
  assert (out / "power.png").stat().st_size > 0
