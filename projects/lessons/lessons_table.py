"""The lessons campaign's deciding figures, from every arm `campaign.sh` ran.

  python projects/lessons/lessons_table.py [--arms projects/lessons/results/arms (the tune and
      decide phases'; the many-worlds series: projects/lessons/results/worlds)]
      [--out projects/lessons/results/lessons] [--reference grpo] [--boot 10000] [--cells w2-ws0]
      [--settings decide] [--level 0.95] [--complete] [--resample all|worlds]

Reads each `<arms>/<w{world}-ws{warm}>/<arm>/summary.json` (compare.py's schema) and its archived
per-step records, and writes to `--out`:
  summary.json   {"runs": [...], "arms": [...], ...}: every run row (method, arm, seed,
                 warm_start_sha1, world_seed, em_curve_mean, em_at_equal_tokens, lessons learned
                 at half and all of the budget, seconds per step, seconds to reach the reference's
                 final EM) and per arm, world seed and phase the means with a hierarchical
                 bootstrap `--level` (95%) interval of the difference to the reference arm
                 (warm starts resampled, then seeds within each; under 3 runs a side, none),
                 and `pooled`: each arm against the reference over world seeds, with the
                 many-worlds series' reading of its interval (`verdict`);
                 and `over_worlds`: per arm the per-world figures averaged over world seeds,
                 with its gain by world summarised (descriptive, no interval);
  summary.md     the same as tables (pooled differences to 4 decimals);
  em_vs_tokens.png, lessons_learned.png, discovery.png, gain_by_world.png, wall_clock.png.

Definitions. Mean EM at equal tokens: the area under held-out EM against cumulative generated
tokens (every token that steers counts: compare.py's `generated_tokens_total`), from 0 to the
smallest total any run of the same world reached, divided by that budget (EM is linear between
evaluations; step 0 is the warm start's). A lesson is learned when its held-out EM is above 0.5
(`eval_em_group/`); `fact_verb` counts lessons whose fact-verb share among held-out searches is
above 0.5 (`eval_fact_verb/`). Discovery: the first evaluation at which a lesson's fact-verb share
passes 0.5, among lessons below it at step 0.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

import numpy as np

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")

from launch.campaign import archived_records, read_summary  # noqa: E402


def eval_curve(records: list[dict]) -> list[dict]:
  """The evaluation records of a run, by step (step 0 first, with 0 tokens)."""
  out = [r for r in records if "eval_em" in r and r.get("step", -1) >= 0]
  out.sort(key=lambda r: r["step"])
  return out


def em_at_equal_tokens(curve: list[dict], budget: float) -> float:
  """Mean held-out EM over [0, budget] generated tokens (see the module docstring); a run whose
  last evaluation came before `budget` holds its last EM."""
  if budget <= 0 or not curve:
    return float("nan")
  x = np.asarray([r.get("generated_tokens_total", 0) for r in curve], np.float64)
  y = np.asarray([r["eval_em"] for r in curve], np.float64)
  if x[-1] < budget:
    x, y = np.append(x, budget), np.append(y, y[-1])
  grid = np.concatenate([x[x < budget], [budget]])
  return float(np.trapezoid(np.interp(grid, x, y), grid) / budget)


def _count_above(rec: dict, prefix: str) -> int:
  return sum(1 for k, v in rec.items() if k.startswith(prefix) and v > 0.5)


def lessons_at(curve: list[dict], tokens: float, prefix: str = "eval_em_group/") -> int | None:
  """Lessons above 0.5 at the last evaluation within `tokens` generated tokens."""
  within = [r for r in curve if r.get("generated_tokens_total", 0) <= tokens]
  return _count_above(within[-1], prefix) if within else None


def unknown_at_start(curve: list[dict]) -> list[str]:
  """Lessons whose fact-verb share is at or below 0.5 at the first evaluation (step 0)."""
  return [k.split("/", 1)[1] for k, v in (curve[0] if curve else {}).items()
          if k.startswith("eval_fact_verb/") and v <= 0.5]


def discovery(curve: list[dict]) -> dict:
  """{lesson: step its fact-verb share first passes 0.5}, lessons at or below 0.5 at step 0."""
  out = {}
  for lesson in unknown_at_start(curve):
    hit = [r["step"] for r in curve if r.get(f"eval_fact_verb/{lesson}", 0.0) > 0.5]
    if hit:
      out[lesson] = int(hit[0])
  return out


def seconds_per_step(records: list[dict]) -> float:
  """Median sampling plus update seconds of the run's steps (evaluations excluded)."""
  v = [r["sample_seconds"] + r["update_seconds"] for r in records
       if "sample_seconds" in r and "update_seconds" in r]
  return float(np.median(v)) if v else float("nan")


def seconds_to_reach(curve: list[dict], records: list[dict], target: float) -> float:
  """Sampling plus update seconds until the first evaluation at or above `target` (nan: never)."""
  hit = next((r["step"] for r in curve if r["eval_em"] >= target), None)
  if hit is None:
    return float("nan")
  return float(sum(r["sample_seconds"] + r["update_seconds"] for r in records
                   if "sample_seconds" in r and r.get("step", 0) <= hit))


def budget_use(records: list[dict]) -> dict:
  """Where a run's budget went, as means over its RL steps: the share of stage-1 trees with mixed
  outcomes (`stage1_mixed`), the share of the step's rollouts that are stage-2 continuations,
  the sampled success rate, how much harder (lower p̂) the prompts the pool selected were
  than those it left out, and the share of steps at which stage 1 gave every selected prompt the
  same number of rollouts (`stage1_even`: its objective chose nothing over a uniform split)
  (TRACE arms; nan where a method has no such figure)."""
  steps = [r for r in records if "effective_ratio" in r]

  def mean(fn):
    v = [fn(r) for r in steps]
    v = [x for x in v if x is not None and np.isfinite(x)]
    return float(np.mean(v)) if v else float("nan")

  return dict(
      stage1_mixed=mean(lambda r: r.get("stage1_mixed")),
      stage2_rollout_share=mean(lambda r: r.get("continuations", 0) / max(
          r.get("stage1_leaves", 0) + r.get("continuations", 0), 1)),
      sampled_success=mean(lambda r: r.get("reward_mean")),
      pool_p_hat_gap=mean(lambda r: r["pool_p_hat_selected"] - r["pool_p_hat_left_out"]
                          if "pool_p_hat_selected" in r and "pool_p_hat_left_out" in r else None),
      stage1_even=mean(lambda r: float(r["root_counts_std"] == 0) if "root_counts_std" in r
                       else None))


def _tails(level: float) -> list[float]:
  if not 0 < level < 1:
    raise ValueError(f"interval level must be in (0, 1), got {level}")
  return [50 * (1 - level), 50 * (1 + level)]


def hierarchical_bootstrap(arm: dict, ref: dict, n: int = 10000, seed: int = 0,
                           level: float = 0.95) -> dict:
  """Difference of means (arm - ref) with a `level` (95%) interval. `arm`, `ref`: {warm start:
  [per-seed values]}. Each replicate draws warm starts with replacement (shared by both arms:
  they start from the same warm starts), then seeds with replacement within each drawn warm
  start."""
  rng = np.random.default_rng(seed)
  wss = sorted(set(arm) & set(ref))
  if not wss:
    return dict(diff=float("nan"), lo=float("nan"), hi=float("nan"), n_warm_starts=0)
  mean_of = lambda d: float(np.mean([np.mean(d[w]) for w in wss]))
  reps = np.empty(n)
  for i in range(n):
    pick = [wss[j] for j in rng.integers(len(wss), size=len(wss))]
    a = [np.mean(rng.choice(arm[w], size=len(arm[w]))) for w in pick]
    b = [np.mean(rng.choice(ref[w], size=len(ref[w]))) for w in pick]
    reps[i] = np.mean(a) - np.mean(b)
  lo, hi = np.percentile(reps, _tails(level))
  return dict(diff=mean_of(arm) - mean_of(ref), lo=float(lo), hi=float(hi),
              n_warm_starts=len(wss))


def pooled_bootstrap(arm: dict, ref: dict, n: int = 10000, seed: int = 0,
                     level: float = 0.95, resample: str = "all") -> dict:
  """Difference of means (arm - ref) pooled over world seeds, with a `level` (95%) interval.
  `arm`, `ref`: {world seed: {warm start: [per-seed values]}}. The point estimate weighs worlds
  equally, and warm starts equally within a world. `resample="all"`: each replicate draws world
  seeds with replacement, then warm starts within each drawn world, then seeds within each warm
  start (both arms share the draw of worlds and warm starts); conservative, as a world's mean
  already holds its seeds' noise and redrawing them adds it again. `resample="worlds"`: each
  replicate draws world seeds only, each with its observed difference: the standard error of
  a mean over independent worlds, right when there are many of them."""
  if resample not in ("all", "worlds"):
    raise ValueError(f"resample must be 'all' or 'worlds', got {resample!r}")
  rng = np.random.default_rng(seed)
  worlds = sorted((w for w in set(arm) & set(ref) if set(arm[w]) & set(ref[w])), key=str)
  if not worlds:
    return dict(diff=float("nan"), lo=float("nan"), hi=float("nan"), n_worlds=0, n_cells=0)
  wss = {w: sorted(set(arm[w]) & set(ref[w]), key=str) for w in worlds}

  def mean_of(d):
    return float(np.mean([np.mean([np.mean(d[w][s]) for s in wss[w]]) for w in worlds]))

  if resample == "worlds":
    per_world = np.array([np.mean([np.mean(arm[w][s]) - np.mean(ref[w][s]) for s in wss[w]])
                          for w in worlds])
    reps = per_world[rng.integers(len(worlds), size=(n, len(worlds)))].mean(axis=1)
  else:
    reps = np.empty(n)
    for i in range(n):
      da, db = [], []
      for w in (worlds[j] for j in rng.integers(len(worlds), size=len(worlds))):
        pick = [wss[w][j] for j in rng.integers(len(wss[w]), size=len(wss[w]))]
        da.append(np.mean([np.mean(rng.choice(arm[w][s], size=len(arm[w][s]))) for s in pick]))
        db.append(np.mean([np.mean(rng.choice(ref[w][s], size=len(ref[w][s]))) for s in pick]))
      reps[i] = np.mean(da) - np.mean(db)
  lo, hi = np.percentile(reps, _tails(level))
  return dict(diff=mean_of(arm) - mean_of(ref), lo=float(lo), hi=float(hi),
              n_worlds=len(worlds), n_cells=sum(len(v) for v in wss.values()))


# The many-worlds series' rule (README, fixed before its first run): "a point" of mean EM, and
# the arm its contrasts are against (the others decide nothing and get no reading).
POINT = 0.010
RULE_REFERENCE = "grpo"


def verdict(lo: float, hi: float, point: float = POINT) -> str:
  """The series' pre-registered reading of a contrast's interval [lo, hi] (arm - reference):
  *gains* if its lower end is above 0, *no gain of a point or more* if its upper end is below
  `point` (GRPO ahead included), both at once *gains, by less than a point*, else *undetermined*.
  Applied to the unrounded ends (the tables print them to 4 decimals)."""
  if not (np.isfinite(lo) and np.isfinite(hi)):
    return "no interval"
  return {(True, True): "gains, by less than a point", (True, False): "gains",
          (False, True): "no gain of a point or more", (False, False): "undetermined"}[
              (bool(lo > 0), bool(hi < point))]


def check_complete(runs: list[dict]) -> None:
  """What `--complete` compares must be comparable: every kept run has a finite mean EM at equal
  tokens (else its arm would lose the seed the others keep, unpaired) and the runs of a setting
  share one run length. Raises SystemExit naming the runs that are not."""
  bad = [r for r in runs if not np.isfinite(float(r.get("em_at_equal_tokens", float("nan"))))]
  if bad:
    raise SystemExit("--complete: no finite mean EM at equal tokens (a broken evaluation "
                     "curve): " + _run_names(bad))
  for setting in sorted({_setting(r["arm"]) for r in runs}):
    steps = {}
    for r in runs:
      if _setting(r["arm"]) == setting and r.get("steps") is not None:
        steps.setdefault(int(r["steps"]), []).append(r)
    if len(steps) > 1:
      raise SystemExit(f"--complete: runs of setting {setting} differ in length: " + "; ".join(
          f"{n} steps: {_run_names(rs)}" for n, rs in sorted(steps.items())))


def complete_seeds(runs: list[dict]) -> tuple[list[dict], list[dict]]:
  """(kept, dropped): a run is kept when every arm of its setting (every arm the folders hold,
  less the `control_`/`old_`/`tune_` prefixes' own sets) has a run of the same seed and warm
  start in its world with an evaluation curve, so a series stopped part-way compares its arms on
  the same (world, seed) pairs. The same warm start means the same parameters (`warm_start_sha1`),
  not only the same seed: a warm start rebuilt on another machine had other parameters (worlds
  20-21 of the series), and arms on two of them are not a paired comparison. A run with no
  curve counts as unfinished. Read one series' folder (or `--cells`): an arm run on some worlds
  only empties the others."""
  keys = [(_setting(r["arm"]), r.get("world_seed"),
           r.get("warm_start_seed", r.get("warm_start_sha1")), r.get("warm_start_sha1"),
           r.get("seed")) for r in runs]
  arms, have = {}, {}
  for r, k in zip(runs, keys):
    arms.setdefault(k[0], set()).add(r["arm"])
    if r.get("curve", True):  # rows without a "curve" field are taken as finished
      have.setdefault(k, set()).add(r["arm"])
  kept, dropped = [], []
  for r, k in zip(runs, keys):
    (kept if have.get(k, set()) == arms[k[0]] else dropped).append(r)
  return kept, dropped


def _spans(values: list[int]) -> str:
  """[6, 7, 8, 10] -> "6-8, 10"."""
  out, vs = [], sorted(values)
  for i, v in enumerate(vs):
    if i and v == vs[i - 1] + 1:
      out[-1][1] = v
    else:
      out.append([v, v])
  return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def mixed_warm_starts(runs: list[dict]) -> list[str]:
  """One line per (world, warm start seed, RL seed) whose arms ran from different warm-start
  parameters (`warm_start_sha1`; a warm start rebuilt on another machine differs): such arms
  are not paired, and `--complete` leaves them out."""
  shas = {}
  for r in runs:
    key = (_setting(r["arm"]), r.get("world_seed"), r.get("warm_start_seed"), r.get("seed"))
    shas.setdefault(key, {}).setdefault(r.get("warm_start_sha1"), set()).add(r["arm"])
  return [f"w{w}, warm start {ws}, seed {seed}: " + "; ".join(
      f"{'/'.join(sorted(a))} from {sha}" for sha, a in sorted(by.items(), key=str))
          for (_, w, ws, seed), by in sorted(shas.items(), key=str) if len(by) > 1]


def progress(runs: list[dict]) -> str:
  """Which runs of a series have finished: counts and names only, no figure of any run, so it
  can be read while a pre-registered series runs (its tables may not be). A run counts when it
  has an evaluation curve; a (world, seed) is complete when every arm the folders hold finished
  it there (the `--complete` rule, one setting)."""
  finished = [r for r in runs if r.get("curve", True)]
  arms = sorted({r["arm"] for r in runs})
  key = lambda r: (r.get("seed"), r.get("warm_start_seed"), r.get("world_seed"))
  done = {}
  for r in finished:
    done.setdefault(key(r), set()).add(r["arm"])
  complete = {key(r) for r in complete_seeds(finished)[0]}
  lines = [f"{len(finished)} finished runs ({len(runs) - len(finished)} unfinished) of "
           f"{len(arms)} arms: {', '.join(arms) or '-'}"]
  for seed, ws in sorted({k[:2] for k in done}, key=str):
    worlds = {k[2]: a for k, a in done.items() if k[:2] == (seed, ws)}
    full = [w for w in worlds if (seed, ws, w) in complete]
    part = sorted((w, a) for w, a in worlds.items() if a != set(arms))
    lines.append(f"seed {seed}, warm start {ws}: {len(full)} worlds complete"
                 + (f" ({_spans(full)})" if full else "")
                 + "".join(f"; w{w} has only {'/'.join(sorted(a))}" for w, a in part))
  lines += [f"arms from different warm starts (not paired, not complete): {m}"
            for m in mixed_warm_starts(finished)]
  return "\n".join(lines)


def load_runs(arms_dir: str, cells: str = "*") -> list[dict]:
  """Every run of every arm in the cells (`w{world}-ws{warm}` folders) matching `cells`: its
  compare.py row plus its evaluation curve and records."""
  runs = []
  for path in sorted(glob.glob(os.path.join(arms_dir, cells, "*", "summary.json"))):
    out_dir = os.path.dirname(path)
    tag = os.path.basename(os.path.dirname(out_dir))
    summary = read_summary(out_dir)
    for row in summary["runs"]:
      recs = archived_records(out_dir, row["run"]) or []
      runs.append(dict(row, tag=tag, world_overrides=[
          o for o in summary.get("overrides", []) if o.startswith("world.")],
          records=recs, curve=eval_curve(recs)))
  return runs


# The per-arm figures of a world (mean and std over its runs), and of the series (`over_worlds`).
ARM_FIGURES = ("em_at_equal_tokens", "em_curve_mean", "effective_ratio", "lessons_learned_half",
               "lessons_learned_all", "fact_verb_lessons_half", "fact_verb_lessons_all",
               "seconds_per_step", "seconds_to_reference_final", "generated_tokens",
               "stage1_mixed", "stage2_rollout_share", "sampled_success", "pool_p_hat_gap",
               "stage1_even", "lessons_unknown_at_start", "lessons_found")
# `over_worlds` splits the gain by world at the reference's sampled success within this of 0.5.
NEAR_HALF = 0.1


def table(runs: list[dict], reference: str = RULE_REFERENCE, boot: int = 10000,
          level: float = 0.95, resample: str = "all") -> dict:
  """Adds the per-run figures and the per-arm aggregates (by world seed and setting)."""
  worlds = {}
  for r in runs:
    key = (r.get("world_seed"), _setting(r["arm"]))
    worlds.setdefault(key, []).append(r)
  arms_out = []
  for (world, setting), rs in sorted(worlds.items(), key=lambda kv: str(kv[0])):
    budget = min((r["curve"][-1].get("generated_tokens_total", 0) for r in rs if r["curve"]),
                 default=0)
    ref = [r for r in rs if r["arm"] == _ref_name(reference, setting)]
    finals = [r["curve"][-1]["eval_em"] for r in ref if r["curve"]]
    ref_final = float(np.mean(finals)) if finals else float("nan")
    for r in rs:
      c = r["curve"]
      r["em_at_equal_tokens"] = em_at_equal_tokens(c, budget)
      r["budget_tokens"] = budget
      r["lessons_learned_half"] = lessons_at(c, budget / 2)
      r["lessons_learned_all"] = lessons_at(c, budget)
      r["fact_verb_lessons_half"] = lessons_at(c, budget / 2, "eval_fact_verb/")
      r["fact_verb_lessons_all"] = lessons_at(c, budget, "eval_fact_verb/")
      r["seconds_per_step"] = seconds_per_step(r["records"])
      r["seconds_to_reference_final"] = seconds_to_reach(c, r["records"], ref_final)
      r["discovery"] = discovery(c)
      r["lessons_unknown_at_start"] = len(unknown_at_start(c))
      r["lessons_found"] = len(r["discovery"])
      r.update(budget_use(r["records"]))
    by_arm = {}
    for r in rs:
      by_arm.setdefault(r["arm"], []).append(r)
    for arm, ars in sorted(by_arm.items()):
      agg = dict(arm=arm, world_seed=world, setting=setting, runs=len(ars),
                 warm_starts=sorted({r.get("warm_start_sha1") for r in ars}, key=str))
      for k in ARM_FIGURES:
        v = [float(r[k]) for r in ars if r.get(k) is not None and np.isfinite(float(r[k]))]
        agg[k] = float(np.mean(v)) if v else None
        agg[k + "_std"] = float(np.std(v, ddof=1)) if len(v) > 1 else None
      if ref and arm != ref[0]["arm"]:
        group = lambda xs: _by_ws(xs, "em_at_equal_tokens")
        agg["vs_reference"] = hierarchical_bootstrap(group(ars), group(ref), n=boot,
                                                     level=level)
        if min(len(ars), len(ref)) < 3:  # a bootstrap of one or two runs a side is no interval
          agg["vs_reference"].update(lo=None, hi=None)
        ha = _by_ws(ars, "lessons_learned_half")
        hr = _by_ws(ref, "lessons_learned_half")
        ma, mr = _mean_nested(ha), _mean_nested(hr)
        agg["lessons_half_ratio"] = ma / mr if mr else None
      arms_out.append(agg)
  gains = world_gains(arms_out, reference)
  return dict(arms=arms_out, pooled=pooled(runs, reference, boot, level, resample),
              level=level, resample=resample, world_gains=gains,
              over_worlds=over_worlds(arms_out, gains, reference))


def world_gains(aggs: list[dict], reference: str = RULE_REFERENCE) -> list[dict]:
  """Per setting, world seed and arm: its difference to the reference in that world (the
  table's `vs_reference` diff), beside the reference's sampled success (its mean reward on the
  rollouts it trained on), a measure of how hard the world is for the policy: where the gain
  might depend on it."""
  ref = {(a["setting"], a["world_seed"]): a for a in aggs
         if a["arm"] == _ref_name(reference, a["setting"])}
  out = []
  for a in aggs:
    r = ref.get((a["setting"], a["world_seed"]))
    vs = a.get("vs_reference")
    if r is None or not vs or not np.isfinite(vs["diff"]):
      continue
    out.append(dict(setting=a["setting"], world_seed=a["world_seed"], arm=a["arm"],
                    gain=vs["diff"],
                    reference_sampled_success=r["sampled_success"], runs=a["runs"],
                    reference_runs=r["runs"]))
  return out


def over_worlds(aggs: list[dict], gains: list[dict],
                reference: str = RULE_REFERENCE) -> list[dict]:
  """Per setting and arm, descriptive (no interval): the mean over world seeds of each world's
  `ARM_FIGURES` (each world weighs the same, as in `pooled`); `lessons_half_ratio`, its mean
  lessons learned at half the budget over the reference's, on the worlds both ran; and from
  `world_gains`: the worlds where it is ahead of the reference, the correlation of its gain
  with the reference's sampled success, and its mean gain where that success is within
  `NEAR_HALF` of 0.5 and elsewhere."""
  by = {}
  for a in aggs:
    by.setdefault((a["setting"], a["arm"]), []).append(a)
  out = []
  for (setting, arm), rows in sorted(by.items()):
    row = dict(setting=setting, arm=arm, worlds=len(rows))
    for k in ARM_FIGURES:
      v = [a[k] for a in rows if a.get(k) is not None]
      row[k] = float(np.mean(v)) if v else None
    ref = {a["world_seed"]: a for a in by.get((setting, _ref_name(reference, setting)), [])}
    pairs = [(a["lessons_learned_half"], ref[a["world_seed"]]["lessons_learned_half"])
             for a in rows if a["world_seed"] in ref and a["lessons_learned_half"] is not None
             and ref[a["world_seed"]]["lessons_learned_half"] is not None]
    den = sum(r for _, r in pairs)
    row["lessons_half_ratio"] = sum(x for x, _ in pairs) / den if pairs and den else None
    gs = [(g["reference_sampled_success"], g["gain"]) for g in gains
          if g["setting"] == setting and g["arm"] == arm
          and g["reference_sampled_success"] is not None]
    near = [y for x, y in gs if abs(x - 0.5) <= NEAR_HALF]
    far = [y for x, y in gs if abs(x - 0.5) > NEAR_HALF]
    corr = None
    if len(gs) > 2 and np.std([x for x, _ in gs]) > 0 and np.std([y for _, y in gs]) > 0:
      corr = float(np.corrcoef([x for x, _ in gs], [y for _, y in gs])[0, 1])
    row.update(gain_worlds=len(gs), worlds_ahead=sum(y > 0 for _, y in gs),
               gain_vs_reference_success_corr=corr,
               gain_near_half=float(np.mean(near)) if near else None, worlds_near_half=len(near),
               gain_elsewhere=float(np.mean(far)) if far else None, worlds_elsewhere=len(far))
    out.append(row)
  return out


def pooled(runs: list[dict], reference: str = RULE_REFERENCE, boot: int = 10000,
           level: float = 0.95, resample: str = "all") -> list[dict]:
  """Each arm against the reference in mean EM at equal tokens, pooled over the world seeds
  where both ran (`pooled_bootstrap`); only where they share more than one world seed."""
  out = []
  for setting in sorted({_setting(r["arm"]) for r in runs}):
    rs = [r for r in runs if _setting(r["arm"]) == setting and
          r.get("em_at_equal_tokens") is not None and np.isfinite(r["em_at_equal_tokens"])]
    nest = {}
    for r in rs:
      nest.setdefault(r["arm"], {}).setdefault(r.get("world_seed"), {}).setdefault(
          r.get("warm_start_seed", r.get("warm_start_sha1")), []).append(
              float(r["em_at_equal_tokens"]))
    ref = nest.get(_ref_name(reference, setting))
    for arm, d in sorted(nest.items()):
      if ref is None or arm == _ref_name(reference, setting) or len(set(d) & set(ref)) < 2:
        continue
      q = pooled_bootstrap(d, ref, n=boot, level=level, resample=resample)
      out.append(dict(setting=setting, arm=arm, reference=_ref_name(reference, setting), **q,
                      verdict=verdict(q["lo"], q["hi"]) if reference == RULE_REFERENCE else None))
  return out


def _setting(arm: str) -> str:
  return "control" if arm.startswith("control_") else "old" if arm.startswith("old_") else (
      "tune" if arm.startswith("tune_") else "decide")


def _ref_name(reference: str, setting: str) -> str:
  return {"control": f"control_{reference}", "old": f"old_{reference}",
          "tune": f"tune_{reference}"}.get(setting, reference)


def _by_ws(runs, key) -> dict:
  out = {}
  for r in runs:
    v = r.get(key)
    if v is not None and np.isfinite(float(v)):
      out.setdefault(r.get("warm_start_seed", r.get("warm_start_sha1")), []).append(float(v))
  return out


def _mean_nested(d: dict) -> float:
  return float(np.mean([np.mean(v) for v in d.values()])) if d else float("nan")


def markdown(result: dict) -> str:
  ci = f"{100 * result.get('level', 0.95):g}% CI"
  lines = [f"| setting | world | arm | runs | mean EM at equal tokens | vs reference ({ci}) | "
           "EM over run | lessons learned half / all | fact-verb lessons half / all | "
           "lessons at half vs reference | effective ratio | s / step | s to reference's final "
           "EM | generated tokens |", "|" + "---|" * 14]
  f = lambda v, d=3: "-" if v is None else f"{v:.{d}f}"
  for a in result["arms"]:
    vs = a.get("vs_reference")
    vs_s = "-" if not vs else f"{vs['diff']:+.3f} " + (
        "(under 3 runs a side)" if vs["lo"] is None else f"[{vs['lo']:+.3f}, {vs['hi']:+.3f}]")
    lines.append(
        f"| {a['setting']} | {a['world_seed']} | {a['arm']} | {a['runs']} | "
        f"{f(a['em_at_equal_tokens'])} ± {f(a['em_at_equal_tokens_std'])} | {vs_s} | "
        f"{f(a['em_curve_mean'])} | {f(a['lessons_learned_half'], 1)} / "
        f"{f(a['lessons_learned_all'], 1)} | {f(a['fact_verb_lessons_half'], 1)} / "
        f"{f(a['fact_verb_lessons_all'], 1)} | {f(a.get('lessons_half_ratio'), 2)} | "
        f"{f(a['effective_ratio'])} | {f(a['seconds_per_step'], 1)} | "
        f"{f(a['seconds_to_reference_final'], 0)} | {f(a['generated_tokens'], 0)} |")
  if result.get("pooled"):
    draws = ("worlds only" if result.get("resample") == "worlds" else
             "worlds, then warm starts, then seeds")
    lines += ["", "Pooled over world seeds (each world's mean EM at equal tokens; bootstrap over "
              f"{draws}):", "",
              f"| setting | arm | vs | worlds | cells | difference ({ci}) | reading (the "
              f"series' rule: lower end > 0 gains; upper end < {POINT:+.3f} no gain of a "
              "point or more) |", "|" + "---|" * 7]
    for q in result["pooled"]:
      lines.append(f"| {q['setting']} | {q['arm']} | {q['reference']} | {q['n_worlds']} | "
                   f"{q['n_cells']} | {q['diff']:+.4f} [{q['lo']:+.4f}, {q['hi']:+.4f}] | "
                   f"{q['verdict'] or '- (not against grpo)'} |")
  if result.get("world_gains"):
    lines += ["", "Gain by world (exploratory): each arm's mean EM at equal tokens minus the "
              "reference's, beside the reference's sampled success:", "",
              "| setting | world | arm | gain | reference's sampled success | runs / reference's |",
              "|" + "---|" * 6]
    for g in result["world_gains"]:
      lines.append(f"| {g['setting']} | {g['world_seed']} | {g['arm']} | {g['gain']:+.3f} | "
                   f"{f(g['reference_sampled_success'])} | {g['runs']} / {g['reference_runs']} |")
  if result.get("over_worlds"):
    lines += ["", "Over worlds (descriptive, no interval): each arm's per-world means averaged "
              "over world seeds; lessons at half the budget against the reference's; its gain by "
              f"world against the reference's sampled success (within {NEAR_HALF} of 0.5 or "
              "not):", "",
              "| setting | arm | worlds | mean EM at equal tokens | lessons learned half / all | "
              "lessons at half vs reference | lessons found / unknown at step 0 | effective "
              "ratio | stage-1 trees mixed | stage-2 share of rollouts | sampled success | "
              "p̂ selected - left out | steps stage 1 split evenly | generated tokens | worlds "
              "ahead | gain near 0.5 (worlds) | gain elsewhere (worlds) | corr(gain, reference's "
              "success) |", "|" + "---|" * 18]
    g = lambda v: "-" if v is None else f"{v:+.4f}"
    for o in result["over_worlds"]:
      lines.append(
          f"| {o['setting']} | {o['arm']} | {o['worlds']} | {f(o['em_at_equal_tokens'])} | "
          f"{f(o['lessons_learned_half'], 2)} / {f(o['lessons_learned_all'], 2)} | "
          f"{f(o['lessons_half_ratio'], 3)} | {f(o['lessons_found'], 2)} / "
          f"{f(o['lessons_unknown_at_start'], 2)} | {f(o['effective_ratio'])} | "
          f"{f(o['stage1_mixed'])} | {f(o['stage2_rollout_share'])} | "
          f"{f(o['sampled_success'])} | {f(o['pool_p_hat_gap'])} | {f(o['stage1_even'], 3)} | "
          f"{f(o['generated_tokens'], 0)} | {o['worlds_ahead']} of {o['gain_worlds']} | "
          f"{g(o['gain_near_half'])} ({o['worlds_near_half']}) | "
          f"{g(o['gain_elsewhere'])} ({o['worlds_elsewhere']}) | "
          f"{f(o['gain_vs_reference_success_corr'], 2)} |")
  lines += ["", "Where the budget went (means over RL steps; see `budget_use`):", "",
            "| setting | world | arm | stage-1 trees mixed | stage-2 share of rollouts | "
            "sampled success | p̂ selected - left out | steps stage 1 split evenly | "
            "lessons found / unknown at step 0 |", "|" + "---|" * 9]
  for a in result["arms"]:
    lines.append(f"| {a['setting']} | {a['world_seed']} | {a['arm']} | {f(a['stage1_mixed'])} | "
                 f"{f(a['stage2_rollout_share'])} | {f(a['sampled_success'])} | "
                 f"{f(a['pool_p_hat_gap'])} | {f(a['stage1_even'], 2)} | "
                 f"{f(a['lessons_found'], 1)} / "
                 f"{f(a['lessons_unknown_at_start'], 1)} |")
  return "\n".join(lines) + "\n"


def _arm_ticks(ax, aggs) -> None:
  ax.set_xticks(np.arange(len(aggs)), [f"{a['setting']}/w{a['world_seed']}/{a['arm']}"
                                       for a in aggs], rotation=60, ha="right", fontsize=7)


def plots(runs: list[dict], result: dict, out_dir: str, lessons: dict | None = None) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  arms = sorted({r["arm"] for r in runs})
  colors = {a: plt.cm.tab10(i % 10) for i, a in enumerate(arms)}
  fig, ax = plt.subplots(figsize=(8, 5))
  for r in runs:
    c = r["curve"]
    ax.plot([x.get("generated_tokens_total", 0) for x in c], [x["eval_em"] for x in c],
            color=colors[r["arm"]], alpha=0.35)
  for a in arms:
    ax.plot([], [], color=colors[a], label=a)
  ax.set(xlabel="generated tokens (cumulative)", ylabel="held-out EM", title="EM against tokens")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, "em_vs_tokens.png"), dpi=110)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(8, 4.5))
  aggs = [a for a in result["arms"] if a["lessons_learned_all"] is not None]
  xs = np.arange(len(aggs))
  ax.bar(xs - 0.2, [a["lessons_learned_half"] or 0 for a in aggs], 0.4, label="half budget")
  ax.bar(xs + 0.2, [a["lessons_learned_all"] or 0 for a in aggs], 0.4, label="whole budget")
  _arm_ticks(ax, aggs)
  ax.set(ylabel="lessons with held-out EM > 0.5", title="lessons learned")
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, "lessons_learned.png"), dpi=110)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(7, 5))
  for r in runs:
    info = (lessons or {}).get((r.get("world_seed"), tuple(r.get("world_overrides", ()))))
    if info is None:
      continue
    d = r["discovery"]
    x = [info[k]["weight"] * info[k]["expert_rate"] for k in d if k in info]
    ax.scatter(x, [d[k] for k in d if k in info], color=colors[r["arm"]], s=12, alpha=0.6)
  for a in arms:
    ax.scatter([], [], color=colors[a], label=a)
  ax.set_xscale("log")
  ax.set(xlabel="frequency x expert rate", ylabel="discovery step",
         title="when each lesson was found")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, "discovery.png"), dpi=110)
  plt.close(fig)

  gains = [g for g in result.get("world_gains", []) if g["reference_sampled_success"] is not None]
  if gains:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for a in sorted({g["arm"] for g in gains}):
      gs = [g for g in gains if g["arm"] == a]
      ax.scatter([g["reference_sampled_success"] for g in gs], [g["gain"] for g in gs],
                 color=colors[a], label=a, s=20)
    ax.axhline(0, color="gray", lw=0.8)
    ax.set(xlabel="reference's sampled success (mean reward on its rollouts)",
           ylabel="mean EM at equal tokens - reference's", title="gain by world")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "gain_by_world.png"), dpi=110)
    plt.close(fig)

  fig, ax = plt.subplots(figsize=(8, 4.5))
  aggs = [a for a in result["arms"] if a["seconds_per_step"] is not None]
  xs = np.arange(len(aggs))
  ax.bar(xs, [a["seconds_per_step"] for a in aggs])
  _arm_ticks(ax, aggs)
  ax.set(ylabel="seconds per RL step (median)", title="wall clock")
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, "wall_clock.png"), dpi=110)
  plt.close(fig)


def world_lessons(world_seed: int, overrides: list[str]) -> dict:
  """The lessons (weight, expert rate) of the world a run trained on (regenerated: seconds)."""
  from configs import mhqa
  from trace_jax.assets import lessons_world_config
  from trace_jax.envs.worlds.lessons_world import generate_lessons_world

  c = mhqa.get_config("lessons")
  for o in overrides:
    key, _, value = o.partition("=")
    sec, _, field = key.partition(".")
    if sec == "world" and field in c.world and field != "seed":
      c.world[field] = type(c.world[field])(value)
  c.world.seed = int(world_seed)
  c.world.kind = "lessons"
  return generate_lessons_world(lessons_world_config(mhqa.validate(c))).lessons


def _run_names(runs: list[dict]) -> str:
  return ", ".join(f"w{r.get('world_seed')}/{r['arm']}/seed{r.get('seed')}" for r in runs)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--arms", default=os.path.join(_ROOT, "projects", "lessons", "results", "arms"))
  p.add_argument("--out", default=os.path.join(_ROOT, "projects", "lessons", "results",
                                               "lessons"))
  p.add_argument("--reference", default=RULE_REFERENCE)
  p.add_argument("--boot", type=int, default=10000)
  p.add_argument("--level", type=float, default=0.95, help="the intervals' level (0.975 for "
                 "two primary contrasts at 95%% together)")
  p.add_argument("--cells", default="*", help="a glob of the cells read, e.g. w2-ws0")
  p.add_argument("--complete", action="store_true", help="keep a run only where every arm of its "
                 "setting finished its seed and warm start in its world (a series stopped "
                 "part-way)")
  p.add_argument("--resample", default="all", choices=("all", "worlds"), help="the pooled "
                 "bootstrap's draws: worlds, warm starts and seeds (all), or worlds only")
  p.add_argument("--settings", default="", help="comma-separated settings kept (decide, tune, "
                 "control, old; default: all)")
  p.add_argument("--plots", action=argparse.BooleanOptionalAction, default=True,
                 help="write the plots (they regenerate each world's lessons: seconds a world)")
  p.add_argument("--progress", action="store_true", help="print which runs have finished (counts "
                 "and names, no figures; safe while a series runs) and write nothing")
  a = p.parse_args(argv)
  runs = load_runs(a.arms, a.cells)
  if a.settings:
    runs = [r for r in runs if _setting(r["arm"]) in a.settings.split(",")]
  if a.progress:
    print(progress(runs))
    return
  dropped = []
  if a.complete:
    runs, dropped = complete_seeds(runs)
    if dropped:
      print(f"left out {len(dropped)} runs whose seed not every arm of their setting finished: "
            + _run_names(dropped))
  if not runs:
    raise SystemExit(f"no arm summaries under {a.arms}/*/*/summary.json")
  mixed = mixed_warm_starts(runs)
  for m in mixed:  # --complete has left these out; without it they would enter unpaired
    print(f"warning: arms from different warm starts: {m}")
  result = table(runs, a.reference, a.boot, a.level, a.resample)
  if a.complete:
    check_complete(runs)
  result["left_out"] = [dict(arm=r["arm"], world_seed=r.get("world_seed"), seed=r.get("seed"),
                             warm_start_seed=r.get("warm_start_seed")) for r in dropped]
  os.makedirs(a.out, exist_ok=True)
  rows = [{k: v for k, v in r.items() if k not in ("records", "curve")} for r in runs]
  with open(os.path.join(a.out, "summary.json"), "w") as f:
    json.dump(dict(command="python projects/lessons/lessons_table.py " + " ".join(
        argv if argv is not None else sys.argv[1:]), runs=rows, **result), f, indent=1)
  with open(os.path.join(a.out, "summary.md"), "w") as f:
    f.write(markdown(result))
    if dropped:
      f.write("\nLeft out (`--complete`: a seed not every arm finished in its world from one "
              "warm start): " + _run_names(dropped) + "\n")
    if mixed:
      f.write("\nWarning, arms from different warm starts (unpaired): " + " | ".join(mixed) + "\n")
  if not a.plots:
    print(markdown(result))
    return
  lessons = {}
  for r in runs:
    key = (r.get("world_seed"), tuple(r["world_overrides"]))
    if r.get("world_seed") is not None and key not in lessons and not r["arm"].startswith("old_"):
      lessons[key] = world_lessons(r["world_seed"], r["world_overrides"])
  plots(runs, result, a.out, lessons)
  print(markdown(result))


if __name__ == "__main__":
  main()
