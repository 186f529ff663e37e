"""projects/lessons/campaign.sh: the jobs a phase issues (a stand-in `python` prints them)."""

import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _run(tmp_path, *args, python='#!/bin/sh\necho "python $*"\n', **env_vars):
  """The lines `campaign.sh ARGS` prints with a stand-in `python` (by default one that prints
  its command line)."""
  (tmp_path / "projects" / "lessons").mkdir(parents=True, exist_ok=True)
  shutil.copy(os.path.join(ROOT, "projects", "lessons", "campaign.sh"),
              tmp_path / "projects" / "lessons" / "campaign.sh")
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir(exist_ok=True)
  (bin_dir / "python").write_text(python)
  (bin_dir / "python").chmod(0o755)
  env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", **env_vars)
  return subprocess.run(["bash", "projects/lessons/campaign.sh", *args], cwd=tmp_path, env=env,
                        capture_output=True, text=True, check=True).stdout.splitlines()


def _jobs(tmp_path, *args, **env_vars):
  """The compare.py command lines `campaign.sh ARGS` would run, in order."""
  return [line for line in _run(tmp_path, *args, **env_vars)
          if line.startswith("python launch/compare.py")]


@pytest.mark.parametrize("phase,world", [("replicate", 3), ("replicate4", 4), ("replicate5", 5)])
def test_replications_run_grpo_and_trace_paper_seed_major_on_their_world(tmp_path, phase, world):
  jobs = _jobs(tmp_path, phase, "0")
  got = [(re.search(r"--arm=(\S+)", j)[1], int(re.search(r"--seeds=(\d+)", j)[1])) for j in jobs]
  assert got == [("grpo", 1), ("trace_paper", 1), ("grpo", 2), ("trace_paper", 2),
                 ("grpo", 3), ("trace_paper", 3)]
  for j in jobs:
    assert f"--set=world.seed={world}" in j and "--warm_start_seed=0" in j
    assert "--set=rl.steps=100" in j and f"w{world}-ws0/" in j
  assert all(("--methods=grpo" in j) == ("--arm=grpo" in j) for j in jobs)
  # A second worker finds every job claimed by the first.
  assert _jobs(tmp_path, phase, "1") == []


@pytest.mark.parametrize("world", [0, 1])
def test_tune_binned_runs_three_arms_on_a_tune_world(tmp_path, world):
  jobs = _jobs(tmp_path, f"tune_binned{world}", "0")
  got = [(re.search(r"--arm=(\S+)", j)[1], int(re.search(r"--seeds=(\d+)", j)[1])) for j in jobs]
  assert got == [(a, s) for s in (1, 2) for a in ("grpo", "trace_paper", "trace_binned")]
  assert all(f"--set=world.seed={world}" in j for j in jobs)
  binned = [j for j in jobs if "--arm=trace_binned" in j]
  assert all("--set=rollout.root_objective=binned" in j and "--methods=trace_tree" in j
             for j in binned)
  assert not any("root_objective" in j for j in jobs if "--arm=trace_binned" not in j)


def test_unknown_phase_is_refused(tmp_path):
  with pytest.raises(subprocess.CalledProcessError):
    _jobs(tmp_path, "replicate9", "0")


def test_a_stopped_workers_claims_are_retaken_a_running_ones_are_not(tmp_path):
  claims = tmp_path / "runs" / "lessons_pilot" / "claims_replicate5"
  host = subprocess.run(["hostname"], capture_output=True, text=True, check=True).stdout.strip()
  dead = subprocess.Popen(["true"])
  dead.wait()
  for k, pid in ((1, dead.pid), (2, os.getpid())):  # job 1's worker is gone, job 2's runs
    (claims / str(k)).mkdir(parents=True)
    (claims / str(k) / "owner").write_text(f"{pid} {host}\n")
  jobs = _jobs(tmp_path, "replicate5", "0")
  got = [(re.search(r"--arm=(\S+)", j)[1], int(re.search(r"--seeds=(\d+)", j)[1])) for j in jobs]
  assert got == [("grpo", 1), ("grpo", 2), ("trace_paper", 2), ("grpo", 3), ("trace_paper", 3)]
  assert (claims / "1" / f"retaken_from_{dead.pid}").is_dir()
  assert _jobs(tmp_path, "replicate5", "1") == []  # now every claim has a live or new owner


def test_the_worlds_series_runs_each_world_whole_every_world_at_seed_0_first(tmp_path):
  jobs = _jobs(tmp_path, "worlds", "0")
  got = [(int(re.search(r"--set=world\.seed=(\d+)", j)[1]), re.search(r"--arm=(\S+)", j)[1],
          int(re.search(r"--seeds=(\d+)", j)[1])) for j in jobs]
  assert got == [(w, a, s) for s in (1, 2) for w in range(6, 30)
                 for a in ("grpo", "trace_paper", "trace_binned")]
  for j in jobs:
    assert "--warm_start_seed=0" in j and "--set=rl.steps=100" in j
    assert "--noprint_summary" in j  # the series' logs hold no tables (its table is read once)
    assert "--out=projects/lessons/results/worlds/w" in j and "--runs=runs/lessons_worlds/w" in j
    assert ("--methods=grpo" in j) == ("--arm=grpo" in j)
    assert ("--methods=trace_tree" in j) == ("--arm=trace_paper" in j or "--arm=trace_binned" in j)
    assert ("--set=rollout.root_objective=binned" in j) == ("--arm=trace_binned" in j)
  assert _jobs(tmp_path, "worlds", "1") == []
  assert len(list((tmp_path / "runs" / "lessons_worlds" / "claims").glob("*/done"))) == 48


def test_a_worlds_job_reruns_its_arms_once_when_some_came_from_a_lost_warm_start(tmp_path):
  # After a job's arms, supersede.py moves out its seed's runs from a lost warm start; when it
  # moved some (exit 3) the arms run again (compare.py reruns only those), then it must find none.
  out = _run(tmp_path, "worlds", "0", python=(  # world 7's first check moves runs, the rest none
      '#!/bin/sh\necho "python $*"\ncase "$*" in *supersede.py*w7-ws0*--seed\\ 0*)\n'
      '  [ -e moved7 ] && exit 0; touch moved7; exit 3;; esac\n'))
  jobs = [(int(re.search(r"--set=world\.seed=(\d+)", j)[1]), re.search(r"--arm=(\S+)", j)[1],
           int(re.search(r"--seeds=(\d+)", j)[1]))
          for j in out if j.startswith("python launch/compare.py")]
  arms = ("grpo", "trace_paper", "trace_binned")
  assert jobs == ([(6, a, 1) for a in arms] + [(7, a, 1) for a in arms] * 2
                  + [(w, a, 1) for w in range(8, 30) for a in arms]
                  + [(w, a, 2) for w in range(6, 30) for a in arms])
  checks = [j for j in out if j.startswith("python projects/lessons/supersede.py")]
  assert len(checks) == 49
  assert checks[0] == ("python projects/lessons/supersede.py --cell "
                       "projects/lessons/results/worlds/w6-ws0 --runs runs/lessons_worlds/w6-ws0 "
                       "--seed 0 --dest projects/lessons/results/worlds_superseded")
  assert checks[-1].endswith("--cell projects/lessons/results/worlds/w29-ws0 --runs "
                             "runs/lessons_worlds/w29-ws0 --seed 1 --dest "
                             "projects/lessons/results/worlds_superseded")


def test_the_deciding_phase_runs_six_arms_with_their_seeds_and_one_flag_table(tmp_path):
  jobs = _jobs(tmp_path, "decide", BEST_BETA="0.25")
  arms = ("grpo", "trace_paper", "trace_best", "dapo", "root_only", "trace_hard")
  assert [(re.search(r"--arm=(\S+)", j)[1], re.search(r"--warm_start_seed=(\d)", j)[1])
          for j in jobs] == [(a, ws) for ws in "01" for a in arms]
  by_arm = {re.search(r"--arm=(\S+)", j)[1]: j.split() for j in jobs[:6]}
  for a, seeds in (("grpo", "--seeds=5"), ("trace_paper", "--seeds=5"),
                   ("trace_best", "--seeds=5"), ("dapo", "--baseline_seeds=3"),
                   ("root_only", "--baseline_seeds=3"), ("trace_hard", "--seeds=3")):
    assert seeds in by_arm[a] and "--set=world.seed=2" in by_arm[a], a
  assert "--methods=dapo" in by_arm["dapo"] and "--methods=root_only" in by_arm["root_only"]
  best = by_arm["trace_best"]
  assert {"--methods=trace_tree", "--set=rl.tree_values=children",
          "--set=rollout.root_objective=discovery",
          "--set=rollout.discovery_beta=0.25"} <= set(best)
  assert "--set=rollout.hard_prompts=4" in by_arm["trace_hard"]
  assert not any("root_objective" in f for f in by_arm["trace_paper"])
  # The control phase's trace_best is the same arm on the flattened world.
  control = {re.search(r"--arm=(\S+)", j)[1]: set(j.split())
             for j in _jobs(tmp_path, "control", BEST_BETA="0.25")}
  assert {f for f in best if f.startswith("--set=r")} <= control["control_trace_best"]
  assert "--set=world.zipf_exponent=0" in control["control_trace_best"]


def test_the_deciding_phase_refuses_trace_best_before_the_tune_phase(tmp_path):
  jobs = _jobs(tmp_path, "decide", "trace_best", "grpo", BEST_BETA="")
  assert [re.search(r"--arm=(\S+)", j)[1] for j in jobs] == ["grpo", "grpo"]


def test_the_worlds_series_reruns_on_other_world_seeds_apart_from_the_preregistered_one(tmp_path):
  out = _run(tmp_path, "worlds", "0", WORLDS="100-101", TAG="fresh")
  jobs = [j for j in out if j.startswith("python launch/compare.py")]
  got = [(int(re.search(r"--set=world\.seed=(\d+)", j)[1]), re.search(r"--arm=(\S+)", j)[1],
          int(re.search(r"--seeds=(\d+)", j)[1])) for j in jobs]
  assert got == [(w, a, s) for s in (1, 2) for w in (100, 101)
                 for a in ("grpo", "trace_paper", "trace_binned")]
  for j in jobs:
    assert "--out=projects/lessons/results/worlds_fresh/w" in j
    assert "--runs=runs/lessons_worlds_fresh/w" in j and "--set=rl.steps=100" in j
  checks = [j for j in out if j.startswith("python projects/lessons/supersede.py")]
  assert len(checks) == 4 and all(
      "--dest projects/lessons/results/worlds_fresh_superseded" in c for c in checks)
  assert len(list((tmp_path / "runs" / "lessons_worlds_fresh" / "claims").glob("*/done"))) == 4
  assert not (tmp_path / "runs" / "lessons_worlds").exists()  # the series' own claims untouched
  listed = _jobs(tmp_path / "list", "worlds", "0", WORLDS="042, 40,42", TAG="pick")
  assert [int(re.search(r"--set=world\.seed=(\d+)", j)[1]) for j in listed] == [42] * 3 + [40] * 3 \
      + [42] * 3 + [40] * 3  # 042 is world 42, each world once, seed 0 everywhere first
  assert all("/w42-ws0" in j or "/w40-ws0" in j for j in listed)
  # A tag keeps its list (jobs are numbered by position): another list under it is refused.
  with pytest.raises(subprocess.CalledProcessError) as e:
    _run(tmp_path, "worlds", "0", WORLDS="102-103", TAG="fresh")
  assert e.value.returncode == 2 and "TAG=fresh ran world seeds 100 101" in e.value.stderr


@pytest.mark.parametrize("env,why", [
    (dict(WORLDS="100-101"), "needs TAG=NAME"),
    (dict(WORLDS="100-101", TAG="a/b"), "needs TAG=NAME"),
    (dict(WORLDS="100-101", TAG="superseded"), "not superseded"),
    (dict(WORLDS="100-101", TAG="x_superseded"), "not superseded"),
    (dict(TAG="fresh"), "without WORLDS"),
    (dict(WORLDS="seven", TAG="t"), "give FIRST-LAST or a list"),
    (dict(WORLDS="30-20", TAG="t"), "names no world seed")])
def test_other_world_seeds_are_refused_without_a_tag_or_with_a_bad_list(tmp_path, env, why):
  with pytest.raises(subprocess.CalledProcessError) as e:
    _run(tmp_path, "worlds", "0", **env)
  assert e.value.returncode == 2 and why in e.value.stderr
