"""`launch/compare.py`: the campaign plan, the aggregation over seeds, and a two-method, one-seed,
few-step smoke of the whole script on the smoke variant (then a rerun that skips finished runs)."""

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("compare", os.path.join(ROOT, "launch",
                                                                        "compare.py"))
compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare)


def test_plan_seeds_budgets_and_shared_runs():
  rows = compare.plan(["trace_tree", "grpo", "arpo"], seeds=5, baseline_seeds=3,
                      regimes=["default", "low_contrast"], budgets=["rollouts", "tokens"],
                      keys={"data.train_hops"})
  count = lambda **kw: sum(all(r[k] == v for k, v in kw.items()) for r in rows)  # noqa: E731
  assert count(method="trace_tree") == 5 * 4 and count(method="arpo") == 3 * 4
  # grpo has no stage 2: its token-budget rows reuse the rollout-budget run.
  grpo_runs = {r["run"] for r in rows if r["method"] == "grpo"}
  assert len(grpo_runs) == 5 * 2 and all("/rollouts/" in r for r in grpo_runs)
  tok = [r for r in rows if r["method"] == "trace_tree" and r["budget"] == "tokens"]
  assert all(r["overrides"]["rollout.budget_unit"] == "tokens" for r in tok)
  low = [r for r in rows if r["regime"] == "low_contrast"]
  assert all(r["overrides"]["data.train_hops"] == "3,4" for r in low)
  for r in low:  # grpo: groups of 4
    ov = r["overrides"]
    total = int(ov["rollout.root_budget"]) + int(ov["rollout.prefix_budget"])
    assert total == 4 * int(ov["rollout.prompts_per_step"])
  no_field = compare.plan(["grpo"], 1, 1, ["low_contrast"], ["rollouts"], keys=set())
  assert "data.train_hops" not in no_field[0]["overrides"]


def test_aggregate_against_grpo():
  rows = [dict(method=m, seed=s, regime="default", budget="rollouts", accuracy_final=acc + s * 0.02,
               effective_ratio=er, generated_tokens=1000, rollouts=128, stage1_mixed=er,
               slice_auc=None, anchor_depth_mean=None)
          for m, acc, er in (("grpo", 0.40, 0.60), ("trace_tree", 0.45, 0.80)) for s in range(3)]
  aggs = {a["method"]: a for a in compare.aggregate(rows)}
  t = aggs["trace_tree"]
  assert t["seeds"] == 3 and t["accuracy_final"]["mean"] == pytest.approx(0.47)
  assert t["accuracy_final"]["std"] == pytest.approx(0.02)  # sample std over seeds
  assert t["er_minus_grpo"] == pytest.approx(0.2)
  assert t["wasted_vs_grpo"] == pytest.approx(0.5)
  assert t["accuracy_minus_grpo"] == pytest.approx(0.05)
  w = t["welch_vs_grpo"]["accuracy_final"]  # equal spreads 0.02 over 3 seeds: se = 0.02 * √(2/3)
  assert w["diff"] == pytest.approx(0.05) and w["se"] == pytest.approx(0.02 * (2 / 3) ** 0.5)
  assert w["df"] == pytest.approx(4.0) and w["n"] == [3, 3]
  assert t["welch_vs_grpo"]["effective_ratio"] is None  # no spread on either side
  assert "welch_vs_grpo" not in aggs["grpo"]
  md = compare.markdown(list(aggs.values()))
  assert "| trace_tree | 3 | 0.470 ± 0.020 | 0.800 ± 0.000 | - | 0.50 | +0.050 |" in md
  # Mixed groups per step: the ratio times the prompts a run trains on. Fewer prompts at a higher
  # ratio can be fewer mixed groups.
  a = compare.with_mixed_groups(dict(effective_ratio=0.665), 24)
  assert a["mixed_groups"] == pytest.approx(15.96) and a["prompts_per_step"] == 24
  assert compare.with_mixed_groups(dict(effective_ratio=None), 24)["mixed_groups"] is None
  row = dict(overrides={"rollout.prompts_per_step": "32"})
  assert compare.prompts_per_step(row, [], 16) == 32
  assert compare.prompts_per_step(row, ["rollout.prompts_per_step=24", "x=1"], 16) == 24
  assert compare.prompts_per_step(dict(overrides={}), [], 16) == 16


SMOKE = ["--config.world.cache_dir={cache}", "--config.rl.steps=1", "--config.sft.steps=3",
         "--config.sft.num_traces=64", "--config.rollout.prompts_per_step=2",
         "--config.rollout.candidate_prompts=3", "--config.rollout.root_budget=4",
         "--config.rollout.prefix_budget=2", "--config.rollout.num_slots=4",
         "--config.rollout.num_pages=256", "--config.eval.size=4", "--config.eval.probe_prompts=2"]


@pytest.mark.slow
def test_compare_smoke_and_resume(tmp_path):
  sets = [f"--set={a[len('--config.'):]}".format(cache=tmp_path / "cache") for a in SMOKE]
  args = [sys.executable, os.path.join(ROOT, "launch", "compare.py"),
          "--config=configs/mhqa.py:smoke", "--methods=trace_tree,grpo", "--seeds=1",
          "--regimes=default", "--budgets=tokens", f"--runs={tmp_path}/runs",
          f"--out={tmp_path}/out", *sets]
  from test_train_smoke import launch_env
  env = launch_env()  # the launched runs' shared compilation cache
  p = subprocess.run(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                     text=True, timeout=900)
  assert p.returncode == 0, p.stdout[-4000:]
  out = json.load(open(tmp_path / "out" / "summary.json"))
  runs = {r["method"]: r for r in out["runs"]}
  assert set(runs) == {"trace_tree", "grpo"}
  for r in runs.values():
    assert r["seed"] == 0 and r["regime"] == "default" and r["budget"] == "tokens"
    assert r["generated_tokens"] > 0 and 0.0 <= r["effective_ratio"] <= 1.0
    # the lessons campaign's row keys: the arm (the method when no --arm), world and warm seeds
    assert r["arm"] == r["method"] and r["world_seed"] == 0 and r["warm_start_seed"] == 0
  assert runs["grpo"]["rollouts"] == 6                 # the whole budget at the roots
  assert runs["grpo"]["run"].startswith("default/rollouts/")  # shared with the rollout mode
  assert runs["trace_tree"]["rollouts"] >= 6           # short continuations: at least as many
  for name in ("summary.md", "em_vs_tokens.png", "effective_ratio.png", "reliability.png",
               "anchor_depths.png", "trap_rollouts.png"):
    assert os.path.getsize(tmp_path / "out" / name) > 0, name
  # both runs restored one warm start (trained once, cached), and the summary says so
  sha = runs["grpo"]["warm_start_sha1"]
  assert len(sha) == 12 and runs["trace_tree"]["warm_start_sha1"] == sha
  assert out["warm_starts"] == {sha: 2}
  md = open(tmp_path / "out" / "summary.md").read()
  assert f"`{sha}` (2 runs)" in md and "Warning" not in md
  written = {n: os.stat(tmp_path / "out" / n).st_mtime_ns for n in ("summary.json", "summary.md")}
  t0 = time.time()
  again = subprocess.run(args, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=300)
  assert again.returncode == 0, again.stdout[-3000:]
  assert "2 already finished" in again.stdout and "[compare] default/" not in again.stdout
  assert time.time() - t0 < 120
  # a rerun that only skipped leaves the summaries as they were (no date-only rewrite)
  assert {n: os.stat(tmp_path / "out" / n).st_mtime_ns for n in written} == written
  # A campaign done in pieces: a plan with a second seed summarizes what exists, trains nothing.
  part = subprocess.run([*args, "--seeds=2", "--summarize_only", "--plots=false",
                         "--noprint_summary"], cwd=ROOT,
                        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        timeout=300)
  assert part.returncode == 0, part.stdout[-3000:]
  assert "[compare] default/" not in part.stdout
  assert "| method |" in again.stdout and "| method |" not in part.stdout  # tables: file only
  summary = json.load(open(tmp_path / "out" / "summary.json"))
  assert {r["seed"] for r in summary["runs"]} == {0}
  assert sorted(summary["missing_runs"]) == ["default/rollouts/grpo-seed1",
                                             "default/tokens/trace_tree-seed1"]
  assert "Planned but not run yet (2)" in open(tmp_path / "out" / "summary.md").read()
  # On another machine, without the run workdirs: the archive in --out stands for them.
  import shutil
  shutil.rmtree(tmp_path / "runs")
  moved = subprocess.run([*args, "--summarize_only", "--plots=false"], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
  assert moved.returncode == 0, moved.stdout[-3000:]
  assert "2 already finished" in moved.stdout
  rows = {r["method"]: r for r in json.load(open(tmp_path / "out" / "summary.json"))["runs"]}
  for m in ("trace_tree", "grpo"):
    for k in ("accuracy_final", "effective_ratio", "generated_tokens", "stage1_mixed"):
      assert rows[m][k] == runs[m][k], (m, k)


def test_carried_rows(tmp_path):
  # An earlier summary's rows: a root-only method's row serves the other budget mode; a two-stage
  # method's row does not.
  old = {"runs": [dict(method="grpo", seed=0, regime="default", budget="rollouts",
                       run="default/rollouts/grpo-seed0", accuracy_final=0.4),
                  dict(method="trace_tree", seed=0, regime="default", budget="rollouts",
                       run="default/rollouts/trace_tree-seed0", accuracy_final=0.5)]}
  path = tmp_path / "summary.json"
  path.write_text(json.dumps(old))
  carried = compare.carried_rows(str(tmp_path), {"default/rollouts/grpo-seed0",
                                             "default/rollouts/trace_tree-seed0"})
  rows = compare.plan(["grpo", "trace_tree"], 1, 1, ["default"], ["rollouts", "tokens"])
  got = {(r["method"], r["budget"]): compare.carried_row(r, carried) for r in rows}
  assert got[("grpo", "tokens")]["budget"] == "tokens"
  assert got[("grpo", "tokens")]["accuracy_final"] == 0.4 and got[("grpo", "tokens")]["carried"]
  assert got[("trace_tree", "rollouts")]["accuracy_final"] == 0.5
  assert got[("trace_tree", "tokens")] is None  # its token-budget run is another run
  assert compare.carried_rows(str(tmp_path / "absent"), set()) == {}  # no summary yet
  # A summary rewritten for a subset keeps the other runs' rows, and they can be carried again.
  assert [r["run"] for r in compare.earlier_rows(str(tmp_path),
                                                 {"default/rollouts/grpo-seed0"})] == [
      "default/rollouts/trace_tree-seed0"]
  path.write_text(json.dumps({"runs": old["runs"][:1], "earlier_runs": old["runs"][1:]}))
  again = compare.carried_rows(str(tmp_path), {"default/rollouts/trace_tree-seed0"})
  assert again["default/rollouts/trace_tree-seed0"]["rollouts"]["accuracy_final"] == 0.5
  assert compare.earlier_rows(str(tmp_path), {"default/rollouts/grpo-seed0",
                                          "default/rollouts/trace_tree-seed0"}) == []
  # A summary that is not JSON (cut short by a kill) stops the campaign before it trains: read as
  # empty, the rewritten summary would drop every earlier row.
  path.write_text('{"runs": [{"method": "gr')
  with pytest.raises(ValueError, match="not a readable campaign summary"):
    compare.carried_rows(str(tmp_path), set())


def test_warm_starts_named_and_mixing_warned():
  table = [dict(run="a", warm_start_sha1="abc"), dict(run="a", warm_start_sha1="abc"),  # 2 budgets
           dict(run="b", warm_start_sha1="abc"), dict(run="c"), dict(run="d", warm_start_sha1=None)]
  counts = compare.warm_starts(table)
  assert counts == {"abc": 2, "unknown": 2}
  line = compare.warm_start_line(counts)
  assert "`abc` (2 runs)" in line and "unrecorded (2 runs" in line and "Warning" not in line
  mixed = compare.warm_start_line(compare.warm_starts(table + [dict(run="e",
                                                                    warm_start_sha1="def")]))
  assert mixed.startswith("**Warning: these runs come from 2 different warm starts")
  assert "`def` (1 run)" in mixed


def test_em_by_step_over_seeds():
  rows = [dict(regime="default", budget="rollouts", method=m, run=f"{m}-{k}")
          for m in ("trace_tree", "grpo") for k in (0, 1)]
  ev = lambda step, em, tok: {"step": step, "eval_em": em, "generated_tokens_total": tok}  # noqa: E731
  recs = {"grpo-0": [ev(0, 0.2, 0), {"step": 1, "effective_ratio": 0.7}, ev(2, 0.3, 10000)],
          "grpo-1": [ev(0, 0.2, 0), ev(2, 0.4, 12000)],
          "trace_tree-0": [ev(0, 0.2, 0), ev(2, 0.5, 9000)], "trace_tree-1": []}
  md = compare.em_by_step(rows, recs)
  assert "| method | seeds | step 0 | step 2 |" in md
  assert "| grpo | 2 | 0.200 ± 0.000 | 0.350 ± 0.071 (11k) |" in md
  assert "| trace_tree | 1 | 0.200 | 0.500 (9k) |" in md  # seed 1 has no records
  assert md.index("| grpo |") < md.index("| trace_tree |")  # the methods' order
  assert compare.em_by_step(rows, {}) == ""
  row = compare.run_row(dict(method="grpo", seed=0, regime="default", budget="rollouts", run="r"),
                        {}, [dict(ev(10, 0.4, 1), eval_em_seen=0.6, eval_em_unseen=0.2)])
  assert (row["accuracy_final_seen"], row["accuracy_final_unseen"]) == (0.6, 0.2)


def test_half_gain_step_and_trap_table():
  ev = lambda step, em: {"step": step, "eval_em": em}  # noqa: E731
  assert compare.half_gain_step([ev(0, 0.2), ev(2, 0.2), ev(4, 0.29), ev(6, 0.31),
                                 ev(8, 0.4)]) == 6  # half of 0.2 -> 0.4 is 0.3
  assert compare.half_gain_step([ev(0, 0.3), ev(2, 0.2)]) is None  # no gain
  assert compare.half_gain_step([ev(0, 0.3)]) is None
  assert compare.curve_mean([ev(0, 0.2), ev(2, 0.2), ev(4, 0.3), ev(6, 0.4)]) == \
      pytest.approx(0.3)  # step 0 left out
  assert compare.curve_mean([ev(0, 0.2)]) is None
  rows = [dict(method="trace_tree", seed=s, regime="default", budget="rollouts",
               accuracy_final=0.3, effective_ratio=0.5, em_half_gain_step=st,
               em_curve_mean=cm, sampled_trap_share=share, reward_trap=0.1)
          for s, st, share, cm in ((1, 8, 0.3, 0.25), (0, 6, 0.5, 0.27))]
  a = compare.aggregate(rows)[0]
  assert a["em_half_gain_step_values"] == [6, 8]  # by seed
  assert a["sampled_trap_share"]["mean"] == pytest.approx(0.4)
  md = compare.markdown([a])
  assert ("| trace_tree | 2 | 7.0 ± 1.4 | 6, 8 | 0.260 ± 0.014 | - | 0.400 ± 0.141 | "
          "0.100 ± 0.000 |") in md  # no grpo runs: no Welch cell
  grpo = [dict(rows[0], method="grpo", em_curve_mean=cm, seed=s)
          for s, cm in ((0, 0.20), (1, 0.22), (2, 0.24))]
  a = next(x for x in compare.aggregate(rows + grpo) if x["method"] == "trace_tree")
  w = a["welch_vs_grpo"]["em_curve_mean"]
  assert w["diff"] == pytest.approx(0.04) and w["n"] == [2, 3]
  assert f"| 0.260 ± 0.014 | +0.040 (t {w['t']:.1f}, df {w['df']:.1f}, p {w['p']:.2g}) |" in \
      compare.markdown([a])


def test_plan_is_seed_major():
  rows = compare.plan(["trace_tree", "grpo"], seeds=2, baseline_seeds=1, regimes=["default"],
                      budgets=["rollouts"])
  assert [(r["method"], r["seed"]) for r in rows] == [
      ("trace_tree", 0), ("grpo", 0), ("trace_tree", 1), ("grpo", 1)]


_PARENT = """
import importlib.util, subprocess, sys
spec = importlib.util.spec_from_file_location("compare", sys.argv[1])
compare = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare)
print("rc", compare.run_forwarding_signals([sys.executable, "-c", sys.argv[2]]), flush=True)
"""
_CHILD = """
import signal, sys, time
def stop(sig, frame):
    print("child got", signal.Signals(sig).name, flush=True)
    sys.exit(75)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
time.sleep(60)
sys.exit(0)
"""


def test_a_stopped_campaign_stops_its_run():
  """SIGTERM to compare.py reaches the training run it started (which checkpoints and exits 75)
  instead of leaving it training alone; compare.py then returns the run's exit status."""
  p = subprocess.Popen([sys.executable, "-c", _PARENT, os.path.join(ROOT, "launch", "compare.py"),
                        _CHILD], stdout=subprocess.PIPE, text=True)
  assert p.stdout.readline().strip() == "ready"
  t0 = time.time()
  p.send_signal(subprocess.signal.SIGTERM)
  out, _ = p.communicate(timeout=30)
  assert time.time() - t0 < 20  # the child did not sleep its 60 s out
  assert out.split() == ["child", "got", "SIGTERM", "rc", "75"], out
  assert p.returncode == 0


def test_a_quiet_failure_shows_the_traceback_not_the_evaluations():
  log = ("[trace_jax] step 10 eval_em=0.4123\n" * 100 + "Traceback (most recent call last):\n"
         '  File "train.py", line 1, in <module>\nValueError: boom\n')
  assert "eval_em=0.4123" in compare.failure_tail(log) and len(compare.failure_tail(log)) == 3000
  quiet = compare.failure_tail(log, traceback_only=True)
  assert quiet.startswith("Traceback") and "ValueError: boom" in quiet and "eval_em" not in quiet
  assert compare.failure_tail("step 10 eval_em=0.41\nKilled\n", traceback_only=True) == ""
