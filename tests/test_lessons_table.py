"""projects/lessons/lessons_table.py: the lessons campaign's figures, on made-up campaign files."""

import gzip
import json
import os

import numpy as np
import pytest

from projects.lessons import lessons_table as lt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _curve(pairs, lessons=None):
  out = []
  for i, (tok, em) in enumerate(pairs):
    r = {"step": 10 * i, "eval_em": em, "generated_tokens_total": tok}
    for k, v in (lessons or [{}] * len(pairs))[i].items():
      r[f"eval_em_group/{k}"] = v
      r[f"eval_fact_verb/{k}"] = v
    out.append(r)
  return out


def test_em_at_equal_tokens_is_the_area_per_token():
  c = _curve([(0, 0.0), (100, 1.0)])
  assert lt.em_at_equal_tokens(c, 100) == pytest.approx(0.5)
  assert lt.em_at_equal_tokens(c, 50) == pytest.approx(0.25)
  assert lt.em_at_equal_tokens(c, 200) == pytest.approx(0.75)  # holds its last EM
  assert np.isnan(lt.em_at_equal_tokens(c, 0))


def test_lessons_and_discovery():
  c = _curve([(0, 0.1), (50, 0.3), (100, 0.6)],
             [{"a": 0.2, "b": 0.7}, {"a": 0.6, "b": 0.8}, {"a": 0.9, "b": 0.9, "c": 0.6}])
  assert lt.lessons_at(c, 60) == 2 and lt.lessons_at(c, 100) == 3 and lt.lessons_at(c, -1) is None
  assert lt.discovery(c) == {"a": 10}  # b was known at step 0, c was never evaluated then
  recs = [{"step": s, "sample_seconds": 1.0, "update_seconds": 0.5} for s in range(1, 21)]
  assert lt.seconds_per_step(recs) == 1.5
  assert lt.seconds_to_reach(c, recs, 0.3) == pytest.approx(15.0)  # steps 1-10
  assert np.isnan(lt.seconds_to_reach(c, recs, 0.99))


def test_hierarchical_bootstrap():
  rng = np.random.default_rng(0)
  ref = {w: list(0.4 + 0.02 * rng.standard_normal(5)) for w in (0, 1)}
  arm = {w: [v + 0.1 for v in ref[w]] for w in (0, 1)}
  b = lt.hierarchical_bootstrap(arm, ref, n=2000)
  assert b["diff"] == pytest.approx(0.1) and b["lo"] > 0.05 and b["hi"] < 0.15
  same = lt.hierarchical_bootstrap(ref, ref, n=2000)
  assert same["lo"] < 0 < same["hi"] and b["n_warm_starts"] == 2
  assert np.isnan(lt.hierarchical_bootstrap({0: [1.0]}, {1: [0.0]})["diff"])


def _write_arm(arms, tag, arm, method, world, ws, em_scale):
  out = arms / tag / arm
  rows = []
  for seed in range(2):
    run = f"default/tokens/{method}-seed{seed}"
    d = out / "runs" / run
    d.mkdir(parents=True)
    recs = [{"step": s, "sample_seconds": 2.0, "update_seconds": 1.0, "reward_mean": em_scale,
             "effective_ratio": 0.5}
            for s in range(1, 21)]
    recs += _curve([(0, 0.1), (1000, 0.1 + em_scale), (2000 + seed, 0.1 + 2 * em_scale)],
                   [{"r00_mentor": 0.2}, {"r00_mentor": 0.4 + em_scale},
                    {"r00_mentor": 0.6}])
    with gzip.open(d / "metrics.jsonl.gz", "wt") as f:
      f.write("\n".join(json.dumps(r) for r in recs) + "\n")
    (d / "summary.json").write_text("{}")
    rows.append(dict(method=method, seed=seed, run=run, arm=arm, world_seed=world,
                     warm_start_seed=ws, warm_start_sha1=f"sha{ws}", em_curve_mean=0.2,
                     effective_ratio=0.5, generated_tokens=2000))
  (out / "summary.json").write_text(json.dumps(dict(runs=rows, overrides=[f"world.seed={world}"])))


def test_main_writes_the_campaign_summary(tmp_path):
  arms = tmp_path / "arms"
  for ws in (0, 1):
    _write_arm(arms, f"w2-ws{ws}", "grpo", "grpo", 2, ws, 0.1)
    _write_arm(arms, f"w2-ws{ws}", "trace_best", "trace_tree", 2, ws, 0.15)
  out = tmp_path / "lessons"
  lt.main([f"--arms={arms}", f"--out={out}", "--boot=500"])
  s = json.loads((out / "summary.json").read_text())
  assert len(s["runs"]) == 8
  for r in s["runs"]:
    for k in ("method", "arm", "seed", "warm_start_sha1", "world_seed", "em_curve_mean",
              "em_at_equal_tokens"):
      assert k in r, k
  best = next(a for a in s["arms"] if a["arm"] == "trace_best")
  assert best["vs_reference"]["diff"] > 0 and best["vs_reference"]["n_warm_starts"] == 2
  assert best["seconds_per_step"] == 3.0 and best["runs"] == 4
  # The one lesson (fact-verb share 0.2 at step 0) is found in every run.
  assert all(r["lessons_unknown_at_start"] == 1 == r["lessons_found"] for r in s["runs"])
  assert "lessons found / unknown at step 0" in (out / "summary.md").read_text()
  # One world: trace_best's gain over grpo there, beside grpo's sampled success (0.1).
  (g,) = s["world_gains"]
  assert (g["world_seed"], g["arm"], g["runs"], g["reference_runs"]) == (2, "trace_best", 4, 4)
  assert g["gain"] == pytest.approx(best["em_at_equal_tokens"] - next(
      a for a in s["arms"] if a["arm"] == "grpo")["em_at_equal_tokens"])
  assert g["gain"] > 0 and g["reference_sampled_success"] == pytest.approx(0.1)
  assert "Gain by world (exploratory)" in (out / "summary.md").read_text()
  (o,) = [o for o in s["over_worlds"] if o["arm"] == "trace_best"]
  assert o["worlds"] == 1 and o["em_at_equal_tokens"] == pytest.approx(best["em_at_equal_tokens"])
  assert "Over worlds (descriptive" in (out / "summary.md").read_text()
  for name in ("summary.md", "em_vs_tokens.png", "lessons_learned.png", "discovery.png",
               "gain_by_world.png", "wall_clock.png"):
    assert (out / name).stat().st_size > 0, name


def test_budget_use_means_over_rl_steps():
  recs = [dict(step=-1, sft_nll=1.0),  # warm start and evaluation records are not RL steps
          dict(step=1, effective_ratio=0.5, stage1_mixed=0.25, stage1_leaves=90, continuations=10,
               reward_mean=0.2, pool_p_hat_selected=0.3, pool_p_hat_left_out=0.5,
               root_counts_std=0.0),
          dict(step=2, effective_ratio=0.5, stage1_mixed=0.75, stage1_leaves=70, continuations=30,
               reward_mean=0.4, pool_p_hat_selected=0.4, pool_p_hat_left_out=0.4,
               root_counts_std=1.5),
          dict(step=2, eval_em=0.3)]
  u = lt.budget_use(recs)
  assert u["stage1_mixed"] == pytest.approx(0.5) and u["stage2_rollout_share"] == pytest.approx(0.2)
  assert u["sampled_success"] == pytest.approx(0.3) and u["pool_p_hat_gap"] == pytest.approx(-0.1)
  assert u["stage1_even"] == pytest.approx(0.5)  # one step of two split evenly
  grpo = lt.budget_use([dict(step=1, effective_ratio=0.4, stage1_mixed=0.4, stage1_leaves=96,
                             reward_mean=0.5)])
  assert grpo["stage2_rollout_share"] == 0.0 and np.isnan(grpo["pool_p_hat_gap"])
  assert np.isnan(grpo["stage1_even"])


def test_pooled_bootstrap_weighs_worlds_equally_and_widens_with_their_spread():
  # Two worlds: +0.04 on one (two warm starts), -0.02 on the other: the point estimate is the
  # mean over worlds (+0.01), not over cells; seeds with no spread leave the worlds' spread only.
  arm = {2: {0: [0.54, 0.54], 1: [0.64, 0.64]}, 3: {0: [0.48, 0.48]}}
  ref = {2: {0: [0.50, 0.50], 1: [0.60, 0.60]}, 3: {0: [0.50, 0.50]}}
  out = lt.pooled_bootstrap(arm, ref, n=2000)
  assert out["diff"] == pytest.approx(0.01)
  assert (out["n_worlds"], out["n_cells"]) == (2, 3)
  assert out["lo"] == pytest.approx(-0.02) and out["hi"] == pytest.approx(0.04)
  # A world only one arm ran is left out.
  arm[4] = {0: [0.9]}
  assert lt.pooled_bootstrap(arm, ref, n=200)["n_worlds"] == 2


def test_pooled_interval_level_sets_the_tails():
  # Ten worlds whose gains are 0.00 .. 0.09 (no seed spread): the bootstrap spread is that of the
  # mean of ten draws from them, and a higher level takes wider tails of the same replicates.
  arm = {w: {0: [0.5 + 0.01 * w]} for w in range(10)}
  ref = {w: {0: [0.5]} for w in range(10)}
  a95 = lt.pooled_bootstrap(arm, ref, n=4000, level=0.95)
  a975 = lt.pooled_bootstrap(arm, ref, n=4000, level=0.975)
  a50 = lt.pooled_bootstrap(arm, ref, n=4000, level=0.5)
  assert a95["diff"] == a975["diff"] == pytest.approx(0.045)
  assert a975["lo"] < a95["lo"] < a50["lo"] < 0.045 < a50["hi"] < a95["hi"] < a975["hi"]
  sd = np.std(np.arange(10) * 0.01) / np.sqrt(10)  # the mean's standard error under resampling
  assert a95["hi"] - a95["lo"] == pytest.approx(2 * 1.96 * sd, rel=0.1)
  assert a975["hi"] - a975["lo"] == pytest.approx(2 * 2.24 * sd, rel=0.1)
  with pytest.raises(ValueError, match="level"):
    lt.pooled_bootstrap(arm, ref, n=10, level=95)


def test_complete_seeds_keeps_only_seeds_every_arm_finished():
  def run(arm, world, seed, ws=0):
    return dict(arm=arm, world_seed=world, warm_start_seed=ws, seed=seed)
  runs = [run(a, 6, s) for a in ("grpo", "trace_paper", "trace_binned") for s in (0, 1)]
  runs += [run("grpo", 7, 0), run("trace_paper", 7, 0), run("trace_binned", 7, 0),
           run("grpo", 7, 1)]  # the series stopped inside world 7's seed 1
  runs += [run("control_grpo", 2, 0), run("control_trace_paper", 2, 0)]  # another setting
  kept, dropped = lt.complete_seeds(runs)
  assert dropped == [run("grpo", 7, 1)]
  assert len(kept) == len(runs) - 1
  # A world whose seed 0 lacks one arm loses that seed for every arm.
  kept, dropped = lt.complete_seeds([run("grpo", 8, 0), run("trace_paper", 8, 0)] + runs[:6])
  assert {(r["world_seed"], r["arm"]) for r in dropped} == {(8, "grpo"), (8, "trace_paper")}


def test_pooled_bootstrap_over_worlds_only_is_the_standard_error_of_a_mean_over_worlds():
  # 40 worlds, 2 seeds a side, noise between seeds: resampling worlds only gives the spread of
  # the mean of the per-world differences; redrawing seeds as well counts their noise twice.
  rng = np.random.default_rng(1)
  arm, ref = {}, {}
  for w in range(40):
    arm[w] = {0: list(0.5 + 0.01 + rng.normal(0, 0.02, 2))}
    ref[w] = {0: list(0.5 + rng.normal(0, 0.02, 2))}
  per_world = np.array([np.mean(arm[w][0]) - np.mean(ref[w][0]) for w in range(40)])
  se = per_world.std() / np.sqrt(40)
  worlds = lt.pooled_bootstrap(arm, ref, n=4000, resample="worlds")
  everything = lt.pooled_bootstrap(arm, ref, n=4000, resample="all")
  assert worlds["diff"] == everything["diff"] == pytest.approx(per_world.mean())
  assert worlds["hi"] - worlds["lo"] == pytest.approx(2 * 1.96 * se, rel=0.1)
  assert everything["hi"] - everything["lo"] > 1.15 * (worlds["hi"] - worlds["lo"])
  with pytest.raises(ValueError, match="resample"):
    lt.pooled_bootstrap(arm, ref, n=10, resample="seeds")


def test_complete_seeds_counts_a_run_without_a_curve_as_unfinished():
  runs = [dict(arm=a, world_seed=6, warm_start_seed=0, seed=0, curve=[{"eval_em": 0.1}])
          for a in ("grpo", "trace_paper")]
  runs[1]["curve"] = []
  kept, dropped = lt.complete_seeds(runs)
  assert kept == [] and len(dropped) == 2


def test_a_world_with_under_three_runs_a_side_gets_no_interval(tmp_path):
  arms = tmp_path / "arms"
  _write_arm(arms, "w6-ws0", "grpo", "grpo", 6, 0, 0.1)
  _write_arm(arms, "w6-ws0", "trace_paper", "trace_tree", 6, 0, 0.15)
  lt.main([f"--arms={arms}", f"--out={tmp_path / 'out'}", "--boot=200", "--no-plots"])
  s = json.loads((tmp_path / "out" / "summary.json").read_text())
  vs = next(a for a in s["arms"] if a["arm"] == "trace_paper")["vs_reference"]
  assert vs["diff"] > 0 and vs["lo"] is None and vs["hi"] is None
  assert "(under 3 runs a side)" in (tmp_path / "out" / "summary.md").read_text()


def test_progress_names_finished_runs_without_figures(tmp_path, capsys):
  def run(arm, world, seed, curve=True):
    return dict(arm=arm, world_seed=world, warm_start_seed=0, seed=seed,
                curve=[{"eval_em": 0.123456}] if curve else [])
  runs = [run(a, w, 0) for a in ("grpo", "trace_paper", "trace_binned") for w in (6, 7, 8, 10)]
  runs += [run("grpo", 11, 0), run("trace_paper", 11, 0), run("trace_binned", 11, 0, curve=False),
           run("grpo", 6, 1)]
  text = lt.progress(runs)
  assert text.splitlines() == [
      "15 finished runs (1 unfinished) of 3 arms: grpo, trace_binned, trace_paper",
      "seed 0, warm start 0: 4 worlds complete (6-8, 10); w11 has only grpo/trace_paper",
      "seed 1, warm start 0: 0 worlds complete; w6 has only grpo"]
  assert "0.12" not in text
  # From the folders: prints the same lines, writes no table
  arms = tmp_path / "arms"
  _write_arm(arms, "w2-ws0", "grpo", "grpo", 2, 0, 0.1)
  lt.main([f"--arms={arms}", f"--out={tmp_path / 'lessons'}", "--progress"])
  assert capsys.readouterr().out.splitlines() == [
      "2 finished runs (0 unfinished) of 1 arms: grpo",
      "seed 0, warm start 0: 1 worlds complete (2)", "seed 1, warm start 0: 1 worlds complete (2)"]
  assert not (tmp_path / "lessons").exists()


def test_arms_from_two_warm_starts_of_one_seed_are_not_paired(capsys, tmp_path):
  # World 20's grpo and trace_paper ran from one warm start, its trace_binned from the same seed's
  # warm start rebuilt on another machine (other parameters): not a paired comparison.
  def run(arm, world, sha):
    return dict(arm=arm, world_seed=world, warm_start_seed=0, warm_start_sha1=sha, seed=0,
                curve=[{"eval_em": 0.5}])
  runs = [run(a, 19, "aaa") for a in ("grpo", "trace_paper", "trace_binned")]
  runs += [run("grpo", 20, "bbb"), run("trace_paper", 20, "bbb"), run("trace_binned", 20, "ccc")]
  kept, dropped = lt.complete_seeds(runs)
  assert kept == runs[:3] and dropped == runs[3:]
  assert lt.mixed_warm_starts(runs) == [
      "w20, warm start 0, seed 0: grpo/trace_paper from bbb; trace_binned from ccc"]
  assert lt.mixed_warm_starts(runs[:3]) == []
  assert lt.progress(runs).splitlines()[1:] == [
      "seed 0, warm start 0: 1 worlds complete (19)",
      "arms from different warm starts (not paired, not complete): "
      "w20, warm start 0, seed 0: grpo/trace_paper from bbb; trace_binned from ccc"]


def test_series_contrast_is_the_mean_over_worlds_of_paired_seed_differences():
  # The many-worlds series' primary contrast, from run rows: per world the mean over its seeds of
  # the paired difference, then the mean over worlds, with a bootstrap over worlds only.
  em = {(6, "grpo"): (.40, .50), (6, "trace_paper"): (.43, .55), (7, "grpo"): (.30, .36),
        (7, "trace_paper"): (.31, .39), (8, "grpo"): (.60, .10), (8, "trace_paper"): (.57, None)}
  runs = [dict(arm=arm, world_seed=w, seed=s, warm_start_seed=0, records=[],
               warm_start_sha1="b" if (w, s) == (7, 1) else "a",  # w7 seed 1: rebuilt warm start
               curve=[dict(step=10 * i, eval_em=v, generated_tokens_total=t) for i, t in
                      enumerate((0, 1000, 2000) if arm == "grpo" else (0, 700, 1500, 2600))])
          for (w, arm), vs in em.items() for s, v in enumerate(vs) if v is not None]
  kept, dropped = lt.complete_seeds(runs)
  assert [(r["world_seed"], r["arm"], r["seed"]) for r in dropped] == [(8, "grpo", 1)]
  (q,) = lt.table(kept, "grpo", boot=2000, level=0.975, resample="worlds")["pooled"]
  per_world = np.array([.04, .02, -.03])  # paired by seed; w8 keeps one seed
  assert q["diff"] == pytest.approx(.01)  # not .018 (cells) nor unpaired w8 (.57-.35)
  assert (q["n_worlds"], q["n_cells"]) == (3, 3)
  reps = per_world[np.random.default_rng(0).integers(3, size=(2000, 3))].mean(axis=1)
  lo, hi = np.quantile(reps, [0.0125, 0.9875])
  assert (q["lo"], q["hi"]) == (pytest.approx(lo), pytest.approx(hi))
  assert q["verdict"] == lt.verdict(lo, hi) == "undetermined"  # lo < 0 < .01 < hi
  (q2,) = lt.table(kept[::-1], "grpo", boot=2000, level=0.975, resample="worlds")["pooled"]
  assert (q2["diff"], q2["lo"], q2["hi"]) == (pytest.approx(.01), pytest.approx(lo),
                                              pytest.approx(hi))
  # the secondary contrast (another reference) gets no reading: the rule is against grpo
  (q3,) = lt.table(kept, "trace_paper", boot=200, level=0.975, resample="worlds")["pooled"]
  assert q3["arm"] == "grpo" and q3["diff"] == pytest.approx(-.01) and q3["verdict"] is None


def test_verdict_is_the_series_rule_on_unrounded_ends():
  assert lt.verdict(0.002, 0.030) == "gains"
  assert lt.verdict(0.001, 0.0096) == "gains, by less than a point"
  assert lt.verdict(-0.004, 0.0096) == "no gain of a point or more"
  assert lt.verdict(-0.004, 0.0104) == "undetermined"  # both print as +0.010 at 3 decimals
  assert lt.verdict(-0.0004, 0.02) == "undetermined" and lt.verdict(0.0004, 0.02) == "gains"
  assert lt.verdict(-0.03, -0.01) == "no gain of a point or more"  # the reference ahead
  assert lt.verdict(float("nan"), float("nan")) == "no interval"


def test_complete_run_of_the_series_writes_the_reading_and_refuses_broken_runs(tmp_path):
  arms = tmp_path / "arms"
  for w in (6, 7, 8):
    _write_arm(arms, f"w{w}-ws0", "grpo", "grpo", w, 0, 0.1)
    _write_arm(arms, f"w{w}-ws0", "trace_paper", "trace_tree", w, 0, 0.15)
  out = tmp_path / "lessons"
  args = [f"--arms={arms}", f"--out={out}", "--boot=500", "--level=0.975", "--complete",
          "--resample=worlds", "--no-plots"]
  lt.main(args)
  s = json.loads((out / "summary.json").read_text())
  (q,) = s["pooled"]
  assert (q["arm"], q["reference"], q["n_worlds"], q["n_cells"]) == ("trace_paper", "grpo", 3, 3)
  assert q["lo"] > 0 and q["verdict"] == "gains"
  md = (out / "summary.md").read_text()
  assert f"{q['diff']:+.4f} [{q['lo']:+.4f}, {q['hi']:+.4f}] | gains |" in md
  assert not list(out.glob("*.png"))  # --no-plots
  # An evaluation gone NaN in one run: --complete refuses rather than leave that seed unpaired.
  run_dir = arms / "w7-ws0" / "trace_paper" / "runs" / "default" / "tokens" / "trace_tree-seed1"
  recs = [json.loads(line) for line in gzip.open(run_dir / "metrics.jsonl.gz", "rt")]
  for r in recs:
    if "eval_em" in r and r["step"] > 0:
      r["eval_em"] = float("nan")
  with gzip.open(run_dir / "metrics.jsonl.gz", "wt") as f:
    f.write("\n".join(json.dumps(r) for r in recs) + "\n")
  with pytest.raises(SystemExit, match="w7/trace_paper/seed1"):
    lt.main(args)


def test_complete_refuses_runs_of_different_lengths():
  runs = [dict(arm=a, world_seed=6, seed=0, steps=100, em_at_equal_tokens=0.3)
          for a in ("grpo", "trace_paper")]
  lt.check_complete(runs)
  runs[1]["steps"] = 60
  with pytest.raises(SystemExit, match="60 steps: w6/trace_paper/seed0"):
    lt.check_complete(runs)


def test_over_worlds_averages_each_worlds_figures_and_summarises_the_gain_by_world():
  def agg(arm, world, em, half, success):
    return dict({k: None for k in lt.ARM_FIGURES}, setting="decide", arm=arm, world_seed=world,
                em_at_equal_tokens=em, lessons_learned_half=half, sampled_success=success)
  # Three worlds; grpo's sampled success 0.5 (near half), 0.8 and 0.9 (elsewhere).
  aggs = [agg("grpo", 1, 0.40, 10, 0.5), agg("grpo", 2, 0.60, 20, 0.8),
          agg("grpo", 3, 0.70, 30, 0.9),
          agg("trace", 1, 0.46, 12, 0.4), agg("trace", 2, 0.58, 18, 0.7),
          agg("trace", 3, 0.69, 33, 0.8)]
  gains = [dict(setting="decide", world_seed=w, arm="trace", gain=d,
                reference_sampled_success=s, runs=2, reference_runs=2)
           for w, d, s in ((1, 0.06, 0.5), (2, -0.02, 0.8), (3, -0.01, 0.9))]
  rows = {o["arm"]: o for o in lt.over_worlds(aggs, gains)}
  t = rows["trace"]
  assert t["worlds"] == 3 and t["em_at_equal_tokens"] == pytest.approx((0.46 + 0.58 + 0.69) / 3)
  assert t["sampled_success"] == pytest.approx((0.4 + 0.7 + 0.8) / 3)
  assert t["effective_ratio"] is None
  assert t["lessons_half_ratio"] == pytest.approx(63 / 60)
  assert (t["gain_worlds"], t["worlds_ahead"]) == (3, 1)
  assert (t["gain_near_half"], t["worlds_near_half"]) == (pytest.approx(0.06), 1)
  assert (t["gain_elsewhere"], t["worlds_elsewhere"]) == (pytest.approx(-0.015), 2)
  assert t["gain_vs_reference_success_corr"] == pytest.approx(
      np.corrcoef([0.5, 0.8, 0.9], [0.06, -0.02, -0.01])[0, 1])
  g = rows["grpo"]  # the reference: its own ratio is 1, and it has no gains against itself
  assert g["lessons_half_ratio"] == pytest.approx(1.0) and g["gain_worlds"] == 0
  assert g["gain_vs_reference_success_corr"] is None and g["gain_near_half"] is None
  md = lt.markdown(dict(arms=[], over_worlds=list(rows.values())))
  assert "| decide | trace | 3 | 0.577 |" in md and "1 of 3" in md
