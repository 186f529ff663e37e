"""Every method from the same warm start, over seeds, two budget modes and two regimes.

  python launch/compare.py --config=configs/mhqa.py                     # the whole campaign
  python launch/compare.py --methods=trace_tree,grpo --seeds=2 --regimes=default --budgets=rollouts
  python launch/compare.py --dry_run                                   # list the runs only

Each run is one `launch/train.py` subprocess with config overrides, in
`<runs>/<regime>/<budget>/<method>-seed<seed>`. A run whose `summary.json` exists is skipped, so the
campaign can be done in pieces and extended with more seeds later. All runs share one warm start
(`sft.seed` fixed by --warm_start_seed, cached under the config's `world.cache_dir`).

Budget modes:
  rollouts  every method starts root_budget + prefix_budget rollouts per step (a continuation from
            an anchor counts as one), as in the paper.
  tokens    equal generated tokens per step: the two-stage methods run with
            rollout.budget_unit=tokens, under which stage 2 receives the generated tokens that
            prefix_budget fresh rollouts would cost (this step's mean stage-1 rollout length times
            prefix_budget) and spends them at each anchor's expected remaining cost, so shorter
            continuations buy more of them. GRPO and DAPO, which spend the whole budget at roots,
            are the reference and run as in the rollout mode (the same run serves both rows). The
            per-run generated tokens are reported, so how equal the spend came out can be checked.
Regimes:
  default       the config as given.
  low_contrast  groups of 4 (32 prompts per step, 128 rollouts; TRACE: 96 at roots out of a pool
                of 64, 32 for stage 2), plus, when the config has the field, a 3-4-hop training mix
                (`data.train_hops=3,4`). Measured on the warm start at T=0.8, groups of 4 are mixed
                0.42/0.56/0.48/0.23 of the time for 1-4 hops, so the mix is what brings GRPO's
                effective ratio to about 0.3.

Writes to --out (default projects/mhqa/results/compare): summary.json
({"runs": [...], "aggregates": [...]}),
summary.md (mean and spread over seeds), em_vs_tokens.png, effective_ratio.png, reliability.png
and anchor_depths.png.

Every finished run is also archived under `<out>/runs/<run>/` (its summary.json and its per-step
metrics as metrics.jsonl.gz), so a committed campaign can be summarized and extended on another
machine without the run workdirs: an archived run counts as finished. Rows of an earlier
summary.json in --out whose run is neither in --runs nor archived (campaigns from before the
archive) are carried over as they are (`"carried": true`); they have no per-step records, so they
enter the tables but not the curves. An invocation that plans a subset of the runs (one method,
fewer seeds) keeps the earlier summary's rows of the other runs under "earlier_runs", out of its
tables, so that a later invocation can still carry them.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from launch.campaign import (  # noqa: E402
  archive_dir,
  archive_run,
  finished_summary,
  one_per_run,
  read_summary,
  run_records,
  write_summary,
)
from launch.seed_stats import fmt as _fmt  # noqa: E402
from launch.seed_stats import fmt_welch, mean_of, wasted_ratio, welch  # noqa: E402
from launch.seed_stats import stats as _stats  # noqa: E402
from trace_jax.allocation import strategies  # noqa: E402

# The campaign's arms, in the order a seed runs them (every registered strategy).
METHODS = ("grpo", "dapo", "tree_grpo", "arpo", "root_only", "trace", "trace_tree")
MAIN_METHODS = ("trace_tree", "trace", "grpo")  # get --seeds; the others --baseline_seeds
# No stage 2: one run serves both budget modes.
ROOT_ONLY_METHODS = tuple(m for m in METHODS if not strategies.get(m).has_stage2())

REGIMES = {
    "default": {},
    "low_contrast": {"rollout.prompts_per_step": "32", "rollout.candidate_prompts": "64",
                     "rollout.root_budget": "96", "rollout.prefix_budget": "32",
                     "rollout.min_per_prompt": "2"},
}
LOW_CONTRAST_HOPS = ("data.train_hops", "3,4")  # applied when the config defines the field
BUDGETS = {"rollouts": {}, "tokens": {"rollout.budget_unit": "tokens"}}

_CONFIG = flags.DEFINE_string("config", "configs/mhqa.py", "configs/mhqa.py[:variant]")
_METHODS = flags.DEFINE_string("methods", ",".join(METHODS), "comma-separated methods")
_SEEDS = flags.DEFINE_integer("seeds", 5, "RL seeds of trace_tree, trace and grpo")
_BASELINE_SEEDS = flags.DEFINE_integer("baseline_seeds", 3, "RL seeds of the other methods")
_REGIMES = flags.DEFINE_string("regimes", "default,low_contrast", "comma-separated regimes")
_BUDGETS = flags.DEFINE_string("budgets", "rollouts,tokens", "comma-separated budget modes")
_WARM_SEED = flags.DEFINE_integer("warm_start_seed", 0, "sft.seed shared by every run")
_SET = flags.DEFINE_multi_string("set", [], "extra config override key=value for every run")
_RUNS = flags.DEFINE_string("runs", "runs/compare", "parent directory of the run workdirs")
_OUT = flags.DEFINE_string("out", "projects/mhqa/results/compare", "output directory")
_DRY = flags.DEFINE_bool("dry_run", False, "list the runs and exit")
_PLOTS = flags.DEFINE_bool("plots", True, "write the plots")
_PRINT = flags.DEFINE_bool("print_summary", True, "print the summary tables at the end, and a "
                           "failed run's log tail (a series whose table is read once, after its "
                           "last run, turns this off: its logs hold no figures, a failure only "
                           "its traceback)")
_ARM = flags.DEFINE_string("arm", "", "a label for this invocation's runs (each run row's `arm`; "
                           "default: the method)")
_SUMMARIZE_ONLY = flags.DEFINE_bool(
    "summarize_only", False, "train nothing: write the summary from the planned runs that have "
    "finished and list the others as missing (a campaign done in pieces)")


# ---- the campaign --------------------------------------------------------------------------------
def prompts_per_step(row, extra, base: int) -> int:
  """The prompts a run trains on per step: --set, else the regime's override, else the config's."""
  sets = dict(x.split("=", 1) for x in extra if "=" in x)
  return int(sets.get("rollout.prompts_per_step")
             or row["overrides"].get("rollout.prompts_per_step") or base)


def with_mixed_groups(table_row: dict, prompts: int) -> dict:
  """Adds `mixed_groups`: mixed groups (trees) per step, effective ratio x prompts per step. A
  method that trains on fewer prompts can raise the ratio without adding contrast; this counts
  it."""
  er = table_row.get("effective_ratio")
  return dict(table_row, prompts_per_step=prompts,
              mixed_groups=None if er is None else er * prompts)


def _load_config(config: str):
  import importlib.util
  path, _, arg = config.partition(":")
  spec = importlib.util.spec_from_file_location("_cfg", os.path.join(_ROOT, path)
                                                if not os.path.isabs(path) else path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config(arg or None)


def _config_keys(c) -> set[str]:
  """Dotted keys of the loaded base config (to apply an override only where the field exists)."""

  def walk(d, prefix=""):
    for k, v in d.items():
      if hasattr(v, "items"):
        yield from walk(v, f"{prefix}{k}.")
      else:
        yield f"{prefix}{k}"
  return set(walk(c))


def plan(methods, seeds, baseline_seeds, regimes, budgets, keys=frozenset()) -> list[dict]:
  """One entry per (regime, budget, method, seed) row; `run` names the workdir that produces it
  (rows of grpo and dapo in both budget modes share one run)."""
  rows = []
  for regime in regimes:
    overrides = dict(REGIMES[regime])
    if regime == "low_contrast" and LOW_CONTRAST_HOPS[0] in keys:
      overrides[LOW_CONTRAST_HOPS[0]] = LOW_CONTRAST_HOPS[1]
    for budget in budgets:
      for m in methods:
        n = seeds if m in MAIN_METHODS else baseline_seeds
        run_budget = "rollouts" if m in ROOT_ONLY_METHODS else budget
        for s in range(n):
          ov = dict(overrides, **BUDGETS[run_budget], method=m, seed=str(s))
          rows.append(dict(method=m, seed=s, regime=regime, budget=budget,
                           run=os.path.join(regime, run_budget, f"{m}-seed{s}"), overrides=ov))
  # Seed-major within a (regime, budget): a campaign stopped part-way has every method on its
  # first seeds rather than all seeds of the first methods.
  order = {(r["regime"], r["budget"]): i for i, r in enumerate(rows)}
  rows.sort(key=lambda r: (order[(r["regime"], r["budget"])], r["seed"]))
  return rows


def train_args(config, workdir, overrides, warm_seed, extra) -> list[str]:
  args = [f"--config={config}", f"--workdir={workdir}", f"--config.sft.seed={warm_seed}"]
  args += [f"--config.{k}={v}" for k, v in overrides.items()]
  return args + [f"--config.{x}" for x in extra]


PREEMPTED = 75  # launch/train.py's exit status after a SIGTERM/SIGINT and its checkpoint


def run_forwarding_signals(cmd, **popen_kwargs) -> int:
  """Runs `cmd` to its end and returns its exit status. A SIGTERM or SIGINT sent to this process
  is passed on to the child (a training run then checkpoints its step and exits with `PREEMPTED`),
  so stopping a campaign never leaves its run training on alone. The child runs in its own
  session: a Ctrl-C at the terminal reaches it once, through this process, not twice (a second
  SIGINT stops a training run at once, without its checkpoint)."""
  child, pending = None, []

  def forward(sig, frame):
    if child is None:
      pending.append(sig)  # arrived while the child was starting
    else:
      child.send_signal(sig)

  old = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
  try:
    child = subprocess.Popen(cmd, start_new_session=True, **popen_kwargs)
    for sig in pending:
      child.send_signal(sig)
    return child.wait()
  finally:
    for sig, handler in old.items():
      signal.signal(sig, handler)


def failure_tail(log_text: str, traceback_only: bool = False) -> str:
  """What a failed run's error shows of its log: the last 3000 characters, or with
  `traceback_only` (a series whose figures are read once) only its last traceback, which holds
  no evaluation lines ("" when there is none: the log's path is given beside it)."""
  if not traceback_only:
    return log_text[-3000:]
  at = log_text.rfind("Traceback (most recent call last)")
  return "" if at < 0 else log_text[at:][-3000:]


def run_one(config, runs_dir, row, warm_seed, extra, archive=None, quiet=False) -> dict:
  """Trains one run (unless its summary exists in `runs_dir` or in `archive`) and returns its
  summary. `quiet`: a failure shows only the run's traceback, not the end of its log."""
  done = finished_summary(runs_dir, archive, row["run"])
  if done:
    return json.load(open(done))
  workdir = os.path.join(runs_dir, row["run"])
  path = os.path.join(workdir, "summary.json")
  os.makedirs(os.path.dirname(workdir), exist_ok=True)
  cmd = [sys.executable, os.path.join(_ROOT, "launch", "train.py"),
         *train_args(config, workdir, row["overrides"], warm_seed, extra)]
  print(f"[compare] {row['run']}: {' '.join(cmd[2:])}", flush=True)
  log = os.path.join(os.path.dirname(workdir), os.path.basename(workdir) + ".log")
  with open(log, "a") as f:  # a resumed run's log continues its stopped one
    rc = run_forwarding_signals(cmd, cwd=_ROOT, stdout=f, stderr=subprocess.STDOUT,
                                env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
  if rc == PREEMPTED:
    raise SystemExit(f"[compare] stopped by a signal: {row['run']} checkpointed its last step; "
                     f"rerun the same command to resume it (log {log})")
  if rc != 0 or not os.path.exists(path):
    tail = failure_tail(open(log).read(), traceback_only=quiet)
    raise RuntimeError(f"run {row['run']} failed (rc={rc}); log {log}:\n{tail}")
  return json.load(open(path))


# ---- collecting ----------------------------------------------------------------------------------
def _summary_rows(out_dir) -> list[dict]:
  """Every row an earlier summary in `out_dir` holds: its tables' rows and the rows it kept for
  runs outside its own plan ([] when there is none yet)."""
  old = read_summary(out_dir, missing_ok=True) or {}
  return list(old.get("runs", [])) + list(old.get("earlier_runs", []))


def carried_rows(out_dir, runs) -> dict:
  """Rows of an earlier summary in `out_dir` for the given runs: {run: {budget: row}}."""
  out = {}
  for r in _summary_rows(out_dir):
    if r.get("run") in runs:
      out.setdefault(r["run"], {})[r["budget"]] = dict(r, carried=True)
  return out


def earlier_rows(out_dir, runs) -> list[dict]:
  """Rows of an earlier summary in `out_dir` for runs NOT in `runs`: an invocation that plans a
  subset keeps them (under "earlier_runs"), so that rewriting the summary loses no result."""
  return [r for r in _summary_rows(out_dir) if r.get("run") not in runs]


def carried_row(row, carried):
  """The carried row for a planned row, or None. A run of a method with no stage 2 serves both
  budget modes, so its row in one mode stands for the other."""
  by_budget = carried.get(row["run"], {})
  if row["budget"] in by_budget:
    return by_budget[row["budget"]]
  if by_budget and row["method"] in ROOT_ONLY_METHODS:
    return dict(next(iter(by_budget.values())), budget=row["budget"])
  return None


def run_row(row, summary, recs) -> dict:
  """The issue's schema plus the stage-1/stage-2 and predictor figures of one run."""
  steps = [r for r in recs if "effective_ratio" in r]
  slice_last = next((r for r in reversed(steps) if "slice_auc" in r), {})
  pred = summary.get("predictor") or {}
  out = dict(method=row["method"], seed=row["seed"], regime=row["regime"], budget=row["budget"],
             accuracy_start=summary.get("accuracy_start"),
             accuracy_final=summary.get("accuracy_final"),
             effective_ratio=summary.get("effective_ratio"),
             generated_tokens=summary.get("generated_tokens"), rollouts=summary.get("rollouts"),
             prefill_tokens=summary.get("prefill_tokens"), tool_calls=summary.get("tool_calls"),
             steps=summary.get("steps"), wall_seconds=summary.get("wall_seconds"),
             stage1_mixed=mean_of(steps, "stage1_mixed"),
             continuations_at_roots=mean_of(steps, "continuations_at_roots"),
             anchor_depth_mean=mean_of(steps, "anchor_depth_mean"),
             root_auc_allocation=(pred.get("root") or {}).get("auc"),
             prefix_auc_allocation=(pred.get("prefix") or {}).get("auc"),
             slice_auc=slice_last.get("slice_auc"), slice_brier=slice_last.get("slice_brier"),
             slice_ece=slice_last.get("slice_ece"), slice_p_gap=slice_last.get("slice_p_gap"),
             slice_n=slice_last.get("slice_n"), run=row["run"],
             warm_start_sha1=(summary.get("warm_start") or {}).get("params_sha1"))
  out.update(sampled_trap_share=mean_of(steps, "sampled_trap_share"),
             reward_trap=mean_of(steps, "reward_trap"),
             stage1_predicted_mixed=mean_of(steps, "stage1_predicted_mixed"),
             stage1_posterior_mixed=mean_of(steps, "stage1_posterior_mixed"),
             clip_frac_last=mean_of(steps, "clip_frac_last"),
             approx_kl_last=mean_of(steps, "approx_kl_last"),
             optimizer_steps=mean_of(steps, "optimizer_steps"))
  evals = [r for r in recs if "eval_em" in r]
  out["em_half_gain_step"] = half_gain_step(evals)
  out["em_curve_mean"] = curve_mean(evals)
  for half in ("seen", "unseen"):  # the test questions whose entity a train question has, or not
    last = next((r for r in reversed(evals) if f"eval_em_{half}" in r), None)
    if last is not None:
      out[f"accuracy_final_{half}"] = last[f"eval_em_{half}"]
  return out


def warm_starts(table) -> dict:
  """{warm-start fingerprint: runs}, over the table's runs (`campaign.one_per_run`); runs that
  recorded none (made before the fingerprint existed) count under "unknown"."""
  out = {}
  for r in one_per_run(table):
    sha = r.get("warm_start_sha1") or "unknown"
    out[sha] = out.get(sha, 0) + 1
  return out


def warm_start_line(counts) -> str:
  """A Markdown line naming the warm starts a table's runs come from; a warning when it mixes
  two or more known ones (then its methods did not all start alike)."""
  known = {k: v for k, v in counts.items() if k != "unknown"}
  parts = [f"`{k}` ({v} run{'s' if v != 1 else ''})" for k, v in sorted(known.items())]
  if counts.get("unknown"):
    parts.append(f"unrecorded ({counts['unknown']} runs, made before runs recorded it)")
  line = "Warm starts (parameter fingerprints): " + ", ".join(parts) + "."
  if len(known) > 1:
    line = (f"**Warning: these runs come from {len(known)} different warm starts; rows from "
            "different warm starts do not compare at equal start.** " + line)
  return line + "\n"


def half_gain_step(evals) -> int | None:
  """The first evaluated step whose held-out EM has made half the run's gain (from the first
  evaluation to the last), a measure of how fast a run learns; None without a gain."""
  ems = [(r.get("step"), r["eval_em"]) for r in evals
         if isinstance(r.get("eval_em"), (int, float)) and r.get("step") is not None]
  if len(ems) < 2 or ems[-1][1] <= ems[0][1]:
    return None
  half = ems[0][1] + 0.5 * (ems[-1][1] - ems[0][1])
  return next(int(st) for st, em in ems if em >= half)


def curve_mean(evals) -> float | None:
  """Mean held-out EM over the evaluations after the first: the area under the learning curve per
  evaluated step, which counts how early a run learns as well as how far, and with evaluations
  every few steps is less noisy than any one step's EM; None without a later evaluation."""
  ems = [r["eval_em"] for r in evals if isinstance(r.get("eval_em"), (int, float))]
  return float(np.mean(ems[1:])) if len(ems) > 1 else None


AGG_KEYS = ("accuracy_final", "effective_ratio", "mixed_groups", "generated_tokens", "rollouts",
            "prefill_tokens", "stage1_mixed", "stage1_predicted_mixed", "slice_auc", "slice_ece",
            "anchor_depth_mean", "accuracy_final_seen",
            "accuracy_final_unseen", "sampled_trap_share", "reward_trap", "em_half_gain_step",
            "em_curve_mean")


WELCH_KEYS = ("accuracy_final", "em_curve_mean", "effective_ratio")


def aggregate(rows) -> list[dict]:
  """Mean and spread over seeds per (regime, budget, method), with the issue's targets against
  GRPO in the same regime and budget mode."""
  groups = {}
  for r in rows:
    groups.setdefault((r["regime"], r["budget"], r["method"]), []).append(r)
  out = []
  for (regime, budget, method), rs in groups.items():
    a = dict(regime=regime, budget=budget, method=method, seeds=len(rs))
    for k in AGG_KEYS:
      a[k] = _stats([r.get(k) for r in rs])
    a["em_half_gain_step_values"] = [r.get("em_half_gain_step") for r in
                                     sorted(rs, key=lambda r: r["seed"])]
    out.append(a)
  for a in out:  # Welch's (unpaired) comparison over seeds with GRPO, same regime and budget
    base = groups.get((a["regime"], a["budget"], "grpo"))
    if base and a["method"] != "grpo":
      rs = groups[(a["regime"], a["budget"], a["method"])]
      a["welch_vs_grpo"] = {k: welch([r.get(k) for r in rs], [r.get(k) for r in base])
                            for k in WELCH_KEYS}
  by_key = {(a["regime"], a["budget"], a["method"]): a for a in out}
  for a in out:
    g = by_key.get((a["regime"], a["budget"], "grpo"))
    if not g or not a["effective_ratio"] or not g["effective_ratio"]:
      continue
    er, ger = a["effective_ratio"]["mean"], g["effective_ratio"]["mean"]
    a["er_minus_grpo"] = er - ger
    a["wasted_vs_grpo"] = wasted_ratio(er, ger)
    if a["accuracy_final"] and g["accuracy_final"]:
      a["accuracy_minus_grpo"] = a["accuracy_final"]["mean"] - g["accuracy_final"]["mean"]
  return out


def em_by_step(rows, recs_by_run) -> str:
  """Held-out EM at each evaluation step (mean ± std over the seeds with records) and the
  generated tokens spent by then, per regime, budget mode and method: whether the accuracy curves
  separate, and when."""
  curves = {}
  for r in rows:
    evals = [x for x in recs_by_run.get(r["run"], []) if "eval_em" in x]
    if evals:
      curves.setdefault((r["regime"], r["budget"], r["method"]), []).append(
          {int(x["step"]): (x["eval_em"], x.get("generated_tokens_total")) for x in evals})
  if not curves:
    return ""
  order = {m: i for i, m in enumerate(METHODS)}
  lines = []
  for regime, budget in sorted({k[:2] for k in curves}):
    keys = sorted((k for k in curves if k[:2] == (regime, budget)),
                  key=lambda k: order.get(k[2], 99))
    steps = sorted({s for k in keys for c in curves[k] for s in c})
    lines += [f"### held-out EM by step: {regime}, equal {budget}", "",
              "| method | seeds | " + " | ".join(f"step {s}" for s in steps) + " |",
              "|---|---" + "|---" * len(steps) + "|"]
    for k in keys:
      cells = []
      for s in steps:
        em = _stats([c[s][0] for c in curves[k] if s in c])
        tok = _stats([c[s][1] for c in curves[k] if s in c and c[s][1] is not None])
        cells.append("-" if em is None else _fmt(em) + ("" if not tok or not tok["mean"] else
                                                         f" ({tok['mean'] / 1e3:.0f}k)"))
      lines.append(f"| {k[2]} | {len(curves[k])} | " + " | ".join(cells) + " |")
    lines.append("")
  lines.append("(in parentheses: mean generated tokens by then)\n")
  return "\n".join(lines)


def markdown(aggs) -> str:
  """One table per regime and budget mode: mean ± std over seeds (sample std)."""
  lines = []
  order = {m: i for i, m in enumerate(METHODS)}
  for regime, budget in sorted({(a["regime"], a["budget"]) for a in aggs}):
    lines += [f"### {regime}, equal {budget}", "",
              "| method | seeds | EM final | effective ratio | mixed groups / step | "
              "1-ER vs grpo | EM - grpo | generated tokens | prefill tokens | rollouts | "
              "stage-1 mixed | slice AUC | anchor depth |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = sorted((a for a in aggs if (a["regime"], a["budget"]) == (regime, budget)),
                  key=lambda a: order.get(a["method"], 99))
    for a in rows:
      tok = a["generated_tokens"]
      tok_s = "-" if tok is None else f"{tok['mean']:.0f} ± {tok['std']:.0f}"
      roll = a["rollouts"]
      roll_s = "-" if roll is None else f"{roll['mean']:.0f}"
      pre = a.get("prefill_tokens")
      pre_s = "-" if pre is None else f"{pre['mean']:.0f}"
      w = a.get("wasted_vs_grpo")
      lines.append(
          f"| {a['method']} | {a['seeds']} | {_fmt(a['accuracy_final'])} | "
          f"{_fmt(a['effective_ratio'])} | {_fmt(a.get('mixed_groups'), 1)} | "
          f"{'-' if w is None else f'{w:.2f}'} | "
          f"{_fmt(a.get('accuracy_minus_grpo'))} | {tok_s} | {pre_s} | {roll_s} | "
          f"{_fmt(a['stage1_mixed'])} | {_fmt(a['slice_auc'])} | "
          f"{_fmt(a['anchor_depth_mean'], 2)} |")
    lines.append("")
    speed = [a for a in rows if a.get("em_half_gain_step") or a.get("sampled_trap_share")]
    if speed:  # how fast each method learns, and how much of it went to trap-hop questions
      lines += [f"Learning speed and trap-hop questions ({regime}, equal {budget}): the first "
                "evaluated step with half the run's EM gain; the mean held-out EM over the "
                "evaluations after step 0 (the area under the learning curve); the share of the "
                "step's sampled prompts with a trap hop, and their rollouts' success rate (means "
                "over steps); vs grpo: the difference in mean EM over the run, Welch's t of it "
                "over seeds, its degrees of freedom and two-sided p.", "",
                "| method | seeds | step of half the gain | per seed | mean EM over the run | "
                "vs grpo (Welch t, df, p) | sampled trap share | trap success |",
                "|---|---|---|---|---|---|---|---|"]
      for a in speed:
        per = ", ".join(str(x) for x in a.get("em_half_gain_step_values") or []) or "-"
        lines.append(f"| {a['method']} | {a['seeds']} | {_fmt(a.get('em_half_gain_step'), 1)} | "
                     f"{per} | {_fmt(a.get('em_curve_mean'))} | "
                     f"{fmt_welch((a.get('welch_vs_grpo') or {}).get('em_curve_mean'))} | "
                     f"{_fmt(a.get('sampled_trap_share'))} | "
                     f"{_fmt(a.get('reward_trap'))} |")
      lines.append("")
  return "\n".join(lines)


# ---- plots ---------------------------------------------------------------------------------------
def _cells(rows):
  return sorted({(r["regime"], r["budget"]) for r in rows})


def _band(ax, x, ys, label):
  ys = np.asarray(ys, np.float64)
  m = np.nanmean(ys, axis=0)
  line, = ax.plot(x, m, "o-", ms=3, label=label)
  if ys.shape[0] > 1:
    ax.fill_between(x, np.nanmin(ys, axis=0), np.nanmax(ys, axis=0), alpha=0.2,
                    color=line.get_color())


def plots(rows, recs_by_run, out_dir) -> list[str]:
  """EM against generated tokens (seed bands: min-max), effective ratio per step, the slice
  reliability diagram, the share of continuations by anchor depth per step, and (synthetic
  world runs that log it) the share of each step's rollouts on trap-hop questions."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  cells = _cells(rows)
  methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
  paths = []

  def grid(name, draw, sharey=False):
    fig, axes = plt.subplots(1, len(cells), figsize=(5.5 * len(cells), 4), squeeze=False,
                             sharey=sharey)
    for ax, cell in zip(axes[0], cells):
      draw(ax, cell)
      ax.set_title(f"{cell[0]}, equal {cell[1]}")
      ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    paths.append(path)

  def runs_of(cell, m):
    return [r["run"] for r in rows if (r["regime"], r["budget"]) == cell and r["method"] == m]

  def em_vs_tokens(ax, cell):
    for m in methods:
      curves = [[r for r in recs_by_run.get(run, []) if "eval_em" in r] for run in runs_of(cell, m)]
      curves = [c for c in curves if c]
      if not curves:
        continue
      n = min(len(c) for c in curves)
      tokens = np.mean([[r.get("generated_tokens_total", 0) for r in c[:n]] for c in curves], 0)
      _band(ax, tokens, [[r["eval_em"] for r in c[:n]] for c in curves], m)
    ax.set(xlabel="generated tokens", ylabel="greedy held-out EM")

  def er_per_step(ax, cell):
    for m in methods:
      curves = [[r["effective_ratio"] for r in recs_by_run.get(run, []) if "effective_ratio" in r]
                for run in runs_of(cell, m)]
      curves = [c for c in curves if c]
      if not curves:
        continue
      n = min(map(len, curves))
      _band(ax, np.arange(1, n + 1), [c[:n] for c in curves], m)
    ax.set(xlabel="RL step", ylabel="effective ratio (mixed trees)", ylim=(0, 1))

  def reliability(ax, cell):
    ax.plot([0, 1], [0, 1], "k--", lw=0.8)
    for m in methods:
      counts, preds, outs = np.zeros(5), np.zeros(5), np.zeros(5)
      for run in runs_of(cell, m):
        last = next((r for r in reversed(recs_by_run.get(run, [])) if "slice_calib0_n" in r), None)
        if last is None:
          continue
        for b in range(5):
          c = last[f"slice_calib{b}_n"]
          if c > 0:
            counts[b] += c
            preds[b] += c * last[f"slice_calib{b}_pred"]
            outs[b] += c * last[f"slice_calib{b}_outcome"]
      ok = counts > 0
      if ok.any():
        ax.plot(preds[ok] / counts[ok], outs[ok] / counts[ok], "o-",
                label=f"{m} (n={counts.sum():.0f})")
    ax.set(xlabel="p̂ at the root (random pool slice)", ylabel="observed success", xlim=(0, 1),
           ylim=(0, 1))

  def anchor_depths(ax, cell):
    for m in methods:
      if m in ROOT_ONLY_METHODS:
        continue
      curves = []
      for run in runs_of(cell, m):
        st = [r for r in recs_by_run.get(run, []) if "continuations_depth0" in r]
        if st:
          curves.append([sum(d * r[f"continuations_depth{d}"] for d in range(4)) /
                         max(sum(r[f"continuations_depth{d}"] for d in range(4)), 1) for r in st])
      if curves:
        n = min(map(len, curves))
        _band(ax, np.arange(1, n + 1), [c[:n] for c in curves], m)
    ax.set(xlabel="RL step", ylabel="mean anchor depth of continuations (0 = root)")

  def trap_rollouts(ax, cell):
    for m in methods:
      curves = [[r["rollouts_trap_share"] for r in recs_by_run.get(run, [])
                 if "rollouts_trap_share" in r] for run in runs_of(cell, m)]
      curves = [c for c in curves if c]
      if curves:
        n = min(map(len, curves))
        _band(ax, np.arange(1, n + 1), [c[:n] for c in curves], m)
    ax.set(xlabel="RL step", ylabel="share of the step's rollouts on trap-hop questions",
           ylim=(0, 1))

  os.makedirs(out_dir, exist_ok=True)
  if any("rollouts_trap_share" in r for recs in recs_by_run.values() for r in recs):
    grid("trap_rollouts.png", trap_rollouts, sharey=True)  # synthetic world runs only
  grid("em_vs_tokens.png", em_vs_tokens)
  grid("effective_ratio.png", er_per_step, sharey=True)
  grid("reliability.png", reliability, sharey=True)
  grid("anchor_depths.png", anchor_depths)
  return paths


# ---- main ----------------------------------------------------------------------------------------
def main(argv):
  del argv
  methods = [m for m in _METHODS.value.split(",") if m]
  unknown = [m for m in methods if m not in METHODS]
  regimes = [r for r in _REGIMES.value.split(",") if r]
  budgets = [b for b in _BUDGETS.value.split(",") if b]
  if unknown or set(regimes) - set(REGIMES) or set(budgets) - set(BUDGETS):
    raise SystemExit(f"unknown methods {unknown}, regimes {set(regimes) - set(REGIMES)} or budgets "
                     f"{set(budgets) - set(BUDGETS)}")
  base = _load_config(_CONFIG.value)
  keys = _config_keys(base)
  if "low_contrast" in regimes and LOW_CONTRAST_HOPS[0] not in keys:
    print(f"[compare] the config has no {LOW_CONTRAST_HOPS[0]}: the low-contrast regime uses "
          "groups of 4 over the whole hop mix", flush=True)
  rows = plan(methods, _SEEDS.value, _BASELINE_SEEDS.value, regimes, budgets, keys)
  todo = sorted({r["run"] for r in rows})
  archive = archive_dir(_OUT.value)
  finished = lambda run: finished_summary(_RUNS.value, archive, run) is not None
  carried = {k: v for k, v in carried_rows(_OUT.value, todo).items() if not finished(k)}
  earlier = earlier_rows(_OUT.value, set(todo))
  done = [r for r in todo if finished(r) or r in carried]
  print(f"[compare] {len(rows)} rows, {len(todo)} runs, {len(done)} already finished"
        + (f" ({len(carried)} carried from the earlier summary)" if carried else ""), flush=True)
  if _DRY.value:
    for r in rows:
      print(r["run"], r["budget"], json.dumps(r["overrides"]))
    return
  summaries, missing = {}, []
  if _SUMMARIZE_ONLY.value:
    missing = [run for run in todo if run not in done]
    rows = [r for r in rows if r["run"] in done]
    if not rows:
      raise SystemExit(f"[compare] none of the {len(todo)} planned runs has finished under "
                       f"{_RUNS.value}")
  table_rows = []  # (planned row, carried row or None)
  for r in rows:
    if r["run"] in carried:
      old = carried_row(r, carried)
      if old is None:  # carried run, but this budget's row was never summarized
        missing.append(f"{r['run']} ({r['budget']})")
        continue
      table_rows.append((r, old))
      continue
    if r["run"] not in summaries:
      summaries[r["run"]] = run_one(_CONFIG.value, _RUNS.value, r, _WARM_SEED.value, _SET.value,
                                    archive, quiet=not _PRINT.value)
      archive_run(os.path.join(_RUNS.value, r["run"]), archive_dir(_OUT.value, r["run"]))
    table_rows.append((r, None))
  recs = {run: run_records(os.path.join(_RUNS.value, run), archive_dir(_OUT.value, run))
          for run in summaries}
  base_prompts = int(base.rollout.prompts_per_step)
  table = [with_mixed_groups(old if old is not None else run_row(r, summaries[r["run"]],
                                                                 recs[r["run"]]),
                             prompts_per_step(r, _SET.value, base_prompts))
           for r, old in table_rows]
  sets = dict(x.split("=", 1) for x in _SET.value if "=" in x)
  world_seed = int(sets.get("world.seed", base.world.seed)) if "world" in base else None
  table = [dict(t, arm=t.get("arm") or _ARM.value or t["method"],
                world_seed=t.get("world_seed", world_seed),
                warm_start_seed=t.get("warm_start_seed", _WARM_SEED.value)) for t in table]
  aggs = aggregate(table)
  os.makedirs(_OUT.value, exist_ok=True)
  out = dict(command="python launch/compare.py " + " ".join(sys.argv[1:]),
             machine=dict(platform=platform.platform(), cpu_count=os.cpu_count()),
             date=time.strftime("%Y-%m-%d %H:%M:%S"), config=_CONFIG.value,
             overrides=_SET.value, warm_start_seed=_WARM_SEED.value,
             regimes={k: REGIMES[k] for k in regimes}, budgets={k: BUDGETS[k] for k in budgets},
             low_contrast_hops=LOW_CONTRAST_HOPS[1] if LOW_CONTRAST_HOPS[0] in keys else None,
             runs=table, aggregates=aggs, missing_runs=missing, earlier_runs=earlier,
             warm_starts=warm_starts(table))
  changed = write_summary(_OUT.value, out)
  md = markdown(aggs)
  curves = em_by_step([r for r, old in table_rows if old is None], recs)
  if curves:
    md += "\n" + curves
  md_path = os.path.join(_OUT.value, "summary.md")
  if changed or not os.path.exists(md_path):  # a skip-only rerun leaves both files as they were
    with open(md_path, "w") as f:
      f.write(f"Command: `{out['command']}`; machine: {platform.platform()}, "
              f"{os.cpu_count()} CPUs. Mean ± sample std over seeds.\n\n"
              + warm_start_line(out["warm_starts"]) + "\n" + md
              + (f"\nPlanned but not run yet ({len(missing)}): "
                 + ", ".join(f"`{m}`" for m in missing) + "\n" if missing else ""))
  if _PLOTS.value:
    plots(table, recs, _OUT.value)
  if _PRINT.value:
    print(md, flush=True)


if __name__ == "__main__":
  app.run(main)
