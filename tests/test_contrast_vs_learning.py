"""`projects/mhqa/contrast_vs_learning.py`: contrast per step against learning, over archived
runs."""

import gzip
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "contrast_vs_learning", os.path.join(ROOT, "projects", "mhqa", "contrast_vs_learning.py"))
cvl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cvl)


def _campaign(d, runs):
  """A compare.py output dir: `runs` is [(method, seed, budget, em_curve_mean, step ERs)]."""
  rows = []
  for method, seed, budget, em, ers in runs:
    run = f"default/{budget}/{method}-seed{seed}"
    (d / "runs" / run).mkdir(parents=True)
    recs = [{"step": 0, "eval_em": 0.2}] + [{"step": i + 1, "effective_ratio": er,
                                             "sampled_trap_share": 0.5}
                                            for i, er in enumerate(ers)]
    with gzip.open(d / "runs" / run / "metrics.jsonl.gz", "wt") as f:
      f.write("".join(json.dumps(r) + "\n" for r in recs))
    row = dict(method=method, seed=seed, regime="default", budget=budget, run=run,
               em_curve_mean=em, mixed_groups=16 * sum(ers) / len(ers),
               effective_ratio=sum(ers) / len(ers), generated_tokens=60000 + 1000 * seed,
               sampled_trap_share=None, prompts_per_step=16)
    rows.append(row)
    if method == "grpo":  # a root-only method's run is listed in both budget modes
      rows.append(dict(row, budget="tokens"))
  (d / "summary.json").write_text(json.dumps({"runs": rows}))


def test_parse_group():
  assert cvl.parse_group("trap world, 16 steps=a,b") == ("trap world, 16 steps", ["a", "b"])
  assert cvl.parse_group("x=y=d") == ("x=y", ["d"])  # the label may hold '='
  for bad in ("nolabel", "=a", "label="):
    with pytest.raises(ValueError, match="LABEL=DIR"):
      cvl.parse_group(bad)


def test_runs_arms_and_correlations(tmp_path):
  # Within each arm the seed with more mixed groups at step 1 learns more; across arms the
  # reverse (arm b has more contrast and learns less), so the two readings disagree in sign.
  # (Values exact in binary, so that the residuals' ties are exact.)
  _campaign(tmp_path / "a", [("grpo", s, "rollouts", 0.25 + 0.0625 * s, [0.5 + 0.125 * s, 0.5])
                             for s in range(3)])
  _campaign(tmp_path / "b", [("trace_tree", s, "rollouts", 0.125 + 0.03125 * s,
                              [0.75 + 0.0625 * s, 0.75]) for s in range(3)])
  runs = cvl.group_runs([str(tmp_path / "a"), str(tmp_path / "b")], first_steps=1)
  assert len(runs) == 6  # grpo's run listed under two budgets is one run
  assert {r["arm"] for r in runs} == {"a:grpo:rollouts", "b:trace_tree:rollouts"}
  # The same directory named twice adds nothing; a two-stage method's token-budget run is an arm
  # of its own.
  assert len(cvl.group_runs([str(tmp_path / "a"), str(tmp_path / "a") + "/"], 1)) == 3
  _campaign(tmp_path / "t", [("trace_tree", 0, "tokens", 0.3, [0.5])])
  assert [r["arm"] for r in cvl.group_runs([str(tmp_path / "t")], 1)] == ["t:trace_tree:tokens"]
  # Filters: by method, and by shell pattern on `<dir name>/<run>`
  ab = [str(tmp_path / "a"), str(tmp_path / "b")]
  assert {r["method"] for r in cvl.group_runs(ab, 1, methods=["grpo"])} == {"grpo"}
  kept = cvl.group_runs(ab, 1, exclude=["b/*/trace_tree-seed[12]", "a/*-seed0"])
  assert sorted((r["dir"], r["seed"]) for r in kept) == [("a", 1), ("a", 2), ("b", 0)]
  assert len(cvl.group_runs(ab, 1, exclude=["*/trace*"])) == 3  # grpo's three
  assert len(cvl.group_runs(ab, 1, methods=["grpo"], exclude=["a/*"])) == 0
  r0 = next(r for r in runs if r["arm"] == "a:grpo:rollouts" and r["seed"] == 2)
  assert r0["early_mixed_groups"] == pytest.approx(16 * 0.75)  # step 1 only
  assert r0["early_trap_share"] == pytest.approx(0.5)
  assert cvl.group_runs([str(tmp_path / "a")], first_steps=2)[2]["early_mixed_groups"] == \
      pytest.approx(16 * 0.625)
  c = cvl.correlate(runs)
  assert c["early_mixed_groups"]["within_arms"]["rho"] == pytest.approx(1.0)
  assert c["early_mixed_groups"]["within_arms"]["n"] == 6  # 6 points: the exact p
  assert c["early_mixed_groups"]["across_arms"] is None  # two arms: below 3 points
  assert c["early_mixed_groups"]["pooled"]["rho"] < 0  # more contrast, less EM, across arms
  assert c["early_mixed_groups"]["arms"] == 2
  assert c["early_trap_share"]["within_arms"] is None  # constant
  md = cvl.markdown([dict(label="g", dirs=["a", "b"], runs=runs, correlations=c)], "cmd", 1)
  # 6 residual points in perfect order: of the 720 orderings of y, 4 reach |rho| = 1 (the order
  # and its reverse, each with y's two tied zeros either way round); the cell shows that p.
  p6 = c["early_mixed_groups"]["within_arms"]["p"]
  assert p6 == pytest.approx(4 / 720)
  assert "| mixed groups / step, first steps | -" in md and f"+1.00 (p {p6:.2g}, n 6) |" in md


def test_command_writes_the_files(tmp_path):
  _campaign(tmp_path / "a", [("grpo", s, "rollouts", 0.30 + 0.01 * s, [0.5 + 0.1 * s])
                             for s in range(4)])
  out = tmp_path / "res" / "cvl"
  p = subprocess.run([sys.executable, "projects/mhqa/contrast_vs_learning.py",
                      f"--group=one world={tmp_path / 'a'}", f"--out={out}", "--first_steps=1"],
                     cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                     timeout=120)
  assert p.returncode == 0, p.stdout[-2000:]
  res = json.load(open(f"{out}.json"))
  assert res["first_steps"] == 1 and len(res["groups"][0]["runs"]) == 4
  assert res["groups"][0]["correlations"]["mixed_groups"]["pooled"]["rho"] == pytest.approx(1.0)
  assert os.path.getsize(f"{out}.png") > 0 and "### one world (4 runs" in open(f"{out}.md").read()
  three = subprocess.run([sys.executable, "projects/mhqa/contrast_vs_learning.py",
                          f"--group=one world={tmp_path / 'a'}", f"--out={out}",
                          "--exclude=*-seed3", "--methods=grpo,dapo"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
  assert three.returncode == 0, three.stdout[-2000:]
  res = json.load(open(f"{out}.json"))
  assert [r["seed"] for r in res["groups"][0]["runs"]] == [0, 1, 2]
  assert "'--exclude=*-seed3'" in res["command"] and "--methods=grpo,dapo" in res["command"]
  few = subprocess.run([sys.executable, "projects/mhqa/contrast_vs_learning.py",
                        f"--group=x={tmp_path / 'a'},{tmp_path / 'missing'}", f"--out={out}"],
                       cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=120)
  assert few.returncode != 0 and "no campaign summary" in few.stdout
  _campaign(tmp_path / "two", [("grpo", s, "rollouts", 0.3, [0.5]) for s in range(2)])
  two = subprocess.run([sys.executable, "projects/mhqa/contrast_vs_learning.py",
                        f"--group=x={tmp_path / 'two'}", f"--out={out}"], cwd=ROOT,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
  assert two.returncode != 0 and "2 runs with a mean EM over the run; need at least 3" in two.stdout
