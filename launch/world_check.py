"""Checks a world's regime before any comparison is run on it, and writes what it found.

  python launch/world_check.py --config=configs/mhqa.py:lessons                  # every part
  python launch/world_check.py --config=configs/mhqa.py:lessons --parts=oracle,names
  python launch/world_check.py --config=configs/mhqa.py:lessons --parts=grpo --seeds=0,1,2 \
      --runs=runs/world_check_lessons --config.rl.steps=200

Parts (each adds its keys to `--out`, a JSON file that keeps the other parts' keys):
  oracle     the scripted oracle's held-out EM (the fact wording every hop, no mistakes):
             `oracle_em`, with what generation dropped to make it 1.0;
  names      `heldout_names_seen`: the share of the names held-out chains pass through that occur
             in some train chain (1.0: no name ceiling);
  lessons    per relation: frequency weight, the expert's fact-wording rate, question counts;
  capacity   SFT on oracle traces (config's SFT otherwise), greedy held-out EM: `capacity_em`
             (a model that can learn every lesson at all should reach 0.9);
  warm_start the run's own warm start (SFT on the expert's traces): `warm_start_em` and EM per
             lesson, and `mixed_share`: groups of `--group` samples on `--mixed_prompts` train
             prompts at temperature 1, the share of groups with mixed outcomes, over the pool and
             per lesson (a question counts under each lesson it needs);
  independence  from the warm start, SFT on traces where one lesson's expert rate is 1 (questions
             that need it, `--independence_steps` steps), for the `--independence_lessons` most
             frequent lessons below one half: how far that lesson's probability of the fact verb
             moves (`lesson_choice_probs`: teacher-forced on the oracle's held-out traces) and, at
             most, any other's (`independence_max_other_shift`); a first version measured the
             fact-verb share of greedy searches, which flips wholesale for lessons near one half;
             `--independence_replay` mixes that share of rows from the other questions' expert
             traces into the teaching, so that forgetting is not read as sharing;
  grpo       GRPO runs of `--seeds` (one warm start: sft.seed 0 unless given; a run resumes when
             its workdir exists), then from their held-out
             curves: `grpo_em50_over_final` (EM at step 50 over final EM, median over seeds),
             `grpo_plateau_step` (first evaluation within 0.02 of the run's best) and
             `discovery_iqr_steps` (interquartile range over lessons and seeds of the first step at
             which a lesson's fact-verb share among held-out searches passes 0.5, lessons above
             0.5 at step 0 left out, and so are lessons never found; `discovery_iqr_steps_by_em`
             the same by per-lesson EM; `discovery_iqr_steps_censored` with the lessons never
             found counted at the step after the run's last, and `discovery_never_found`).
The world's own parts (oracle, names, lessons) take seconds; capacity and warm_start train a warm
start each (cached under world.cache_dir); grpo trains `len(seeds)` runs.
"""

import json
import logging
import os
import subprocess
import sys
import time

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from absl import logging as absl_logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

PARTS = ("oracle", "names", "lessons", "capacity", "warm_start", "independence", "grpo")
_CONFIG = config_flags.DEFINE_config_file("config", os.path.join(_ROOT, "configs", "mhqa.py"),
                                          "configs/mhqa.py[:variant]")
_PARTS = flags.DEFINE_list("parts", list(PARTS), f"any of {PARTS}")
_OUT = flags.DEFINE_string("out", os.path.join(_ROOT, "projects", "lessons", "results",
                                               "world_check_lessons.json"), "results file")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "GRPO run seeds (part grpo)")
_RUNS = flags.DEFINE_string("runs", os.path.join(_ROOT, "runs", "world_check"),
                            "folder of the GRPO runs (part grpo)")
_GROUP = flags.DEFINE_integer("group", 8, "samples per prompt for the mixed share (warm_start)")
_MIXED_PROMPTS = flags.DEFINE_integer("mixed_prompts", 256, "train prompts sampled (warm_start)")
_IND_LESSONS = flags.DEFINE_integer("independence_lessons", 3, "lessons taught (independence)")
_IND_STEPS = flags.DEFINE_integer("independence_steps", 150, "SFT steps a lesson (independence)")
_IND_REPLAY = flags.DEFINE_float(
    "independence_replay", 0.0, "share of the teaching rows that replay the warm start's own "
    "expert traces of the other questions (0: the taught lesson's questions only); separates "
    "forgetting under a narrow fine-tune from lessons that share something")


def _typed(cdict):
  from configs import convert
  return convert.to_train_config(cdict)


def world_parts(c, parts) -> dict:
  """oracle, names and lessons: the world alone (no model)."""
  from trace_jax.assets import load_world_assets, seen_entities
  from trace_jax.envs.worlds.synthetic import expert_trace, oracle_world

  assets = load_world_assets(c)
  world = assets.world
  out = {}
  if "oracle" in parts:
    perfect, rng = oracle_world(world), np.random.default_rng(0)
    correct = [expert_trace(perfect, e, rng).correct for e in world.test]
    out["oracle_em"] = float(np.mean(correct))
    out["oracle_n"] = len(correct)
    out["generation"] = dict(world.generation)
  if "names" in parts:
    seen = seen_entities(world)
    needed = {x for e in world.test for x in e.meta["chain"]}
    out["heldout_names_seen"] = len(needed & seen) / max(len(needed), 1)
    out["heldout_names"] = len(needed)
  if "lessons" in parts and world.lessons:
    train_n = {r: 0 for r in world.lessons}
    test_n = dict(train_n)
    for split, counts in ((world.train, train_n), (world.test, test_n)):
      for e in split:
        for r in set(e.meta["relations"]) & set(world.lessons):
          counts[r] += 1
    out["lessons"] = {r: dict(weight=v["weight"], expert_rate=v["expert_rate"],
                              train_questions=train_n[r], test_questions=test_n[r])
                      for r, v in world.lessons.items()}
    out["n_train"], out["n_test"] = len(world.train), len(world.test)
    out["hops_train"] = {str(h): sum(e.hops == h for e in world.train) for h in range(1, 5)}
  return out


_BUILT = {}  # sft.traces -> the run built for it (the warm_start and independence parts share one)


def _build(c):
  """The run of `c` (its warm start trained or restored), built once per warm-start kind."""
  import dataclasses

  from trace_jax import train as T

  if c.sft.traces not in _BUILT:
    _BUILT[c.sft.traces] = T.build(dataclasses.replace(
        c, workdir=os.path.join(c.workdir or "runs", "world_check_build")))
  return _BUILT[c.sft.traces]


def _evaluate_warm_start(c, mixed: bool) -> dict:
  """Builds the run (its warm start trained or restored), evaluates greedily on the held-out
  set, and with `mixed` samples groups on train prompts."""
  from trace_jax import train as T
  from trace_jax.evaluate import evaluate
  from trace_jax.sampling.engine import PromptRequest

  run = _build(c)
  run.engine.update_params(T.policy_params(run.init_params, c.model.param_dtype))
  t0 = time.time()
  # Chunks the size the run's own evaluation and steps use: the KV pool is sized for them.
  res = evaluate(run.engine, run.assets.test, batch=c.eval.size, keep_trees=True)
  diag = run.assets.eval_diagnostics(res["trees"])
  out = dict(em=res["em"], n=res["n"], em_by_hops=res["em_by_hops"],
             em_by_lesson=res["em_by_group"],
             lessons_above_half=sum(v > 0.5 for v in res["em_by_group"].values()),
             fact_verb_by_lesson={k.split("/", 1)[1]: v for k, v in diag.items() if "/" in k},
             fact_verb_prob_by_lesson=lesson_choice_probs(run, run.init_params,
                                                          run.assets.world.test),
             lessons_known=diag.get("lessons_known"),
             warm_start=dict(params_sha1=run.warm_start.get("params_sha1"),
                             rows=run.warm_start.get("rows"),
                             expert_success=run.warm_start.get("expert_success")),
             eval_seconds=time.time() - t0)
  if mixed:
    rng = np.random.default_rng(0)
    pool = run.assets.train
    idx = rng.choice(len(pool), size=min(_MIXED_PROMPTS.value, len(pool)), replace=False)
    examples = [pool[int(i)] for i in idx]
    by_lesson, flags_all, rewards = {}, [], []
    per = max(1, c.rollout.prompts_per_step)
    for i in range(0, len(examples), per):
      chunk = examples[i:i + per]
      trees = run.engine.run([PromptRequest(e["prompt_ids"], _GROUP.value, meta=e)
                              for e in chunk])
      for e, t in zip(chunk, trees):
        r = [float(leaf.reward or 0.0) for leaf in t.leaves()]
        rewards += r
        m = bool(0 < np.mean(r) < 1)
        flags_all.append(m)
        for g in e.get("groups") or ():
          by_lesson.setdefault(g, []).append(m)
      run.engine.release(trees)
    out["mixed_share"] = float(np.mean(flags_all))
    out["mixed_share_by_lesson"] = {g: float(np.mean(v)) for g, v in sorted(by_lesson.items())}
    out["sample_success"] = float(np.mean(rewards))
    out["mixed_prompts"] = len(examples)
  return out


def lesson_choice_probs(run, params, examples, chunk: int = 64) -> dict:
  """`trace_jax.diagnostics.lesson_choice_probs` of the run's model with `params`."""
  from trace_jax.diagnostics import lesson_choice_probs as probs

  return probs(run.graphdef, params, run.assets, examples, chunk)


def _with_replay(packed: dict, c, assets, world, lesson: str, n_taught: int, share: float) -> dict:
  """`packed` rows plus rows of the warm start's expert traces (the untaught world) of the
  questions without `lesson`, about `share` of all rows (shuffled together)."""
  from trace_jax.warm_start import warm_start_data
  if not 0 < share < 1:
    raise ValueError(f"--independence_replay={share} must be in (0, 1) (0: no replay)")
  others = [e for e in world.train if lesson not in e.meta["relations"]]
  _, rep = warm_start_data(c, assets, num_traces=max(1, round(n_taught * share / (1 - share))),
                           examples=others)
  n = packed["tokens"].shape[0]
  rows = {k for k, v in packed.items() if isinstance(v, np.ndarray) and v.ndim and v.shape[0] == n}
  order = np.random.default_rng(0).permutation(n + rep["tokens"].shape[0])
  return {k: (np.concatenate([v, rep[k]])[order] if k in rows else v) for k, v in packed.items()}


def independence_part(c) -> dict:
  """Teaches single lessons on top of the warm start and measures every lesson before and after:
  the policy's probability of the fact verb at each hop of the oracle's held-out traces
  (`lesson_choice_probs`), and greedy held-out EM."""
  import dataclasses

  import jax
  import jax.numpy as jnp

  from trace_jax import train as T
  from trace_jax.warm_start import warm_start_data
  from trace_jax.evaluate import evaluate
  from trace_jax.sft import SFTConfig, sft_train

  run = _build(c)
  world, dtype = run.assets.world, c.model.param_dtype

  def measure(params):
    run.engine.update_params(T.policy_params(params, dtype))
    em = evaluate(run.engine, run.assets.test, batch=c.eval.size)["em"]
    return lesson_choice_probs(run, params, world.test), em

  base, base_em = measure(run.init_params)
  n_train = {r: sum(r in e.meta["relations"] for e in world.train) for r in world.lessons}
  # The most frequent lessons the warm start has not learned (fact verb below one half).
  cands = sorted((r for r, v in base.items() if v < 0.5),
                 key=lambda r: -n_train[r])[:_IND_LESSONS.value]
  out = {"base_em": base_em, "base_probs": base, "taught": {}}
  shifts = []
  for k in cands:
    taught = dataclasses.replace(world, lessons={**world.lessons,
                                                 k: dict(world.lessons[k], expert_rate=1.0)})
    examples = [e for e in world.train if k in e.meta["relations"]]
    n_taught = min(c.sft.num_traces, 40 * len(examples))
    _, packed = warm_start_data(c, dataclasses.replace(run.assets, world=taught),
                                num_traces=n_taught, examples=examples)
    if _IND_REPLAY.value > 0:
      packed = _with_replay(packed, c, run.assets, world, k, n_taught, _IND_REPLAY.value)
    cfg = SFTConfig(steps=_IND_STEPS.value, batch_rows=c.sft.batch_rows, lr=c.sft.lr / 3,
                    warmup=10, min_lr_ratio=c.sft.min_lr_ratio)
    start = jax.tree.map(jnp.copy, run.init_params)  # sft_train donates what it is given
    params, _ = sft_train(run.graphdef, start, packed, cfg, seed=1, desc=f"teach {k}")
    after, em = measure(params)
    other = {r: after[r] - base[r] for r in base if r != k and r in after}
    worst = max(other, key=lambda r: abs(other[r])) if other else None
    out["taught"][k] = dict(before=base[k], after=after[k], em_after=em,
                            replay=_IND_REPLAY.value, rows=int(packed["tokens"].shape[0]),
                            max_other_shift=abs(other[worst]) if worst else float("nan"),
                            max_other_lesson=worst, others_measured=len(other),
                            mean_abs_other_shift=float(np.mean(np.abs(list(other.values()))))
                            if other else float("nan"))
    if worst:
      shifts.append(abs(other[worst]))
  out["independence_max_other_shift"] = max(shifts) if shifts else float("nan")
  return out


def grpo_part(seeds, runs_dir, overrides) -> dict:
  """Trains (or resumes) a GRPO run per seed and reads their held-out curves."""
  os.makedirs(runs_dir, exist_ok=True)
  curves = {}
  for s in seeds:
    wd = os.path.join(runs_dir, f"grpo-seed{s}")
    if not os.path.exists(os.path.join(wd, "summary.json")):
      # One warm start for every seed (sft.seed 0 unless given), as compare.py's runs share one.
      cmd = [sys.executable, os.path.join(_ROOT, "launch", "train.py"),
             f"--config={_config_arg()}", "--config.method=grpo", f"--config.seed={s}",
             "--config.sft.seed=0", f"--workdir={wd}"] + [
                 o for o in overrides if not o.startswith(("--config.seed=", "--config.method="))]
      print("[world_check]", " ".join(cmd), flush=True)
      subprocess.run(cmd, check=True)
    curves[s] = read_curve(os.path.join(wd, "metrics.jsonl"))
  return summarize_grpo(curves)


def read_curve(path: str) -> dict:
  """{step: {"em": held-out EM, "lessons": {lesson: EM}, "fact_verb": {lesson: share}}} from a
  run's metrics.jsonl."""
  out = {}
  with open(path) as f:
    for line in f:
      rec = json.loads(line)
      if "eval_em" in rec and rec.get("step", -1) >= 0:
        out[int(rec["step"])] = dict(
            em=float(rec["eval_em"]),
            lessons={k.split("/", 1)[1]: float(v) for k, v in rec.items()
                     if k.startswith("eval_em_group/")},
            fact_verb={k.split("/", 1)[1]: float(v) for k, v in rec.items()
                       if k.startswith("eval_fact_verb/")})
  return out


def discovery_steps(curve: dict, key: str = "fact_verb", never=None) -> list:
  """Per lesson below one half at the first evaluation: the first evaluated step at which it is
  above one half (`key`: "fact_verb", the lesson's fact-verb share among held-out searches, or
  "lessons", its held-out EM). Lessons never found are left out, or given `never` (e.g. a step
  past the run's end: a censored reading) when it is not None."""
  steps = sorted(curve)
  out = []
  for lesson, v0 in curve[steps[0]][key].items():
    if v0 > 0.5:
      continue
    hit = [s for s in steps if curve[s][key].get(lesson, 0.0) > 0.5]
    if hit:
      out.append(hit[0])
    elif never is not None:
      out.append(never)
  return out


def summarize_grpo(curves: dict) -> dict:
  """The grpo part's figures from {seed: read_curve(...)}."""
  ratio, plateau, discovery, discovery_em, finals = [], [], [], [], []
  censored, never = [], 0
  for curve in curves.values():
    steps = sorted(curve)
    ems = [curve[s]["em"] for s in steps]
    final, best = ems[-1], max(ems)
    finals.append(final)
    at50 = [curve[s]["em"] for s in steps if s <= 50]
    if at50 and final > 0:
      ratio.append(at50[-1] / final)
    plateau.append(next(s for s, e in zip(steps, ems) if e >= best - 0.02))
    discovery += discovery_steps(curve, "fact_verb")
    discovery_em += discovery_steps(curve, "lessons")
    # Lessons not found within the run counted as found just after it (a lower bound on their
    # step): the spread of discovery including the lessons the run leaves undiscovered.
    with_never = discovery_steps(curve, "fact_verb", never=steps[-1] + 1)
    censored += with_never
    never += sum(x == steps[-1] + 1 for x in with_never)
  iqr = lambda v: float(np.subtract(*np.percentile(v, [75, 25]))) if v else float("nan")
  return dict(grpo_em50_over_final=float(np.median(ratio)) if ratio else float("nan"),
              grpo_plateau_step=float(np.median(plateau)) if plateau else float("nan"),
              grpo_final_em=[float(x) for x in finals],
              discovery_iqr_steps=iqr(discovery),
              discovery_steps=sorted(int(x) for x in discovery),
              discovery_iqr_steps_by_em=iqr(discovery_em),
              discovery_iqr_steps_censored=iqr(censored), discovery_never_found=never,
              discovery_steps_by_em=sorted(int(x) for x in discovery_em),
              grpo_seeds=sorted(curves))


def plot(out: dict, path: str) -> bool:
  """The lessons at a glance: frequency against the expert's fact-verb rate, colored by the warm
  start's probability of the fact verb (`lesson_choice_probs`; files from before it: its greedy
  fact-verb share); the warm start's mixed share of groups per lesson; and, once the
  grpo part ran, the discovery steps. Returns whether it wrote `path`."""
  lessons = out.get("lessons")
  if not lessons:
    return False
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  names = sorted(lessons)
  w = np.array([lessons[r]["weight"] for r in names])
  eps = np.array([lessons[r]["expert_rate"] for r in names])
  ws = out.get("warm_start") or {}
  fv = ws.get("fact_verb_prob_by_lesson") or ws.get("fact_verb_by_lesson") or {}
  what = ("probability of the fact verb" if ws.get("fact_verb_prob_by_lesson")
          else "fact-verb share")
  mixed = ws.get("mixed_share_by_lesson") or {}
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
  ax = axes[0]
  col = np.array([fv.get(r, np.nan) for r in names])
  known = ~np.isnan(col)
  ax.scatter(w[~known], eps[~known], c="lightgray", s=60, edgecolors="k")  # not searched yet
  sc = ax.scatter(w[known], eps[known], c=col[known], cmap="viridis", vmin=0, vmax=1, s=60,
                  edgecolors="k")
  ax.set_xscale("log")
  ax.set(xlabel="relation weight (question frequency)", ylabel="expert's fact-verb rate ε",
         title=f"lessons (color: warm start's {what})")
  fig.colorbar(sc, ax=ax)
  ax = axes[1]
  m = [mixed.get(r, np.nan) for r in names]
  ax.scatter(eps, m, s=20 + 400 * w / w.max(), alpha=0.7)
  if "mixed_share" in ws:
    ax.axhline(ws["mixed_share"], ls="--", c="gray", label=f"pool {ws['mixed_share']:.2f}")
    ax.legend()
  ax.set(xlabel="expert's fact-verb rate ε", ylabel="mixed share of groups at the warm start",
         title="contrast by lesson (size: frequency)")
  ax = axes[2]
  steps = out.get("discovery_steps") or []
  if steps:
    ax.hist(steps, bins=20)
    ax.set(title=f"GRPO discovery steps (IQR {out.get('discovery_iqr_steps', float('nan')):.0f})")
  else:
    ax.text(0.5, 0.5, "grpo part not run", ha="center", va="center")
  ax.set(xlabel="step a lesson's fact-verb share passes 0.5", ylabel="lessons (all seeds)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def _config_arg() -> str:
  for a in sys.argv[1:]:
    if a.startswith("--config="):
      return a.split("=", 1)[1]
  return "configs/mhqa.py:lessons"


def main(argv):
  del argv
  logging.getLogger("bm25s").setLevel(logging.WARNING)
  absl_logging.set_verbosity(absl_logging.WARNING)
  parts = [p.strip() for p in _PARTS.value if p.strip()]
  bad = sorted(set(parts) - set(PARTS))
  if bad:
    raise app.UsageError(f"--parts: unknown {bad}; choose from {PARTS}")
  cdict = _CONFIG.value
  c = _typed(cdict)
  out = {}
  if os.path.exists(_OUT.value):
    with open(_OUT.value) as f:
      out = json.load(f)
  out["config"] = _config_arg()
  out["world"] = dict(kind=c.world.kind, seed=c.world.seed)
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)

  def save():  # after every part: a later part's failure loses nothing
    with open(_OUT.value, "w") as f:
      json.dump(out, f, indent=1, sort_keys=True)
  wp = [p for p in parts if p in ("oracle", "names", "lessons")]
  if wp:
    out.update(world_parts(c, wp))
    save()
  if "capacity" in parts:
    import dataclasses
    cap = _evaluate_warm_start(dataclasses.replace(c, sft=dataclasses.replace(c.sft,
                                                                            traces="oracle")),
                               mixed=False)
    out["capacity"] = cap
    out["capacity_em"] = cap["em"]
    save()
  if "warm_start" in parts:
    ws = _evaluate_warm_start(c, mixed=True)
    out["warm_start"] = ws
    out["warm_start_em"] = ws["em"]
    save()
  if "independence" in parts:
    ind = independence_part(c)
    out["independence"] = ind
    out["independence_max_other_shift"] = ind["independence_max_other_shift"]
    save()
  if "grpo" in parts:
    overrides = [a for a in sys.argv[1:] if a.startswith("--config.")]
    out.update(grpo_part(_SEEDS.value, _RUNS.value, overrides))
  save()
  keys = ("oracle_em", "heldout_names_seen", "capacity_em", "warm_start_em",
          "independence_max_other_shift", "grpo_em50_over_final", "discovery_iqr_steps")
  print(json.dumps({k: out.get(k) for k in keys}, indent=1))
  print(f"[world_check] wrote {_OUT.value}")
  png = os.path.splitext(_OUT.value)[0] + ".png"
  if plot(out, png):
    print(f"[world_check] wrote {png}")


if __name__ == "__main__":
  app.run(main)
