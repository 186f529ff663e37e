"""Probes the cached warm start: is there contrast to learn from, and can the predictor see it?

  python projects/mhqa/probe_warm_start.py --config=configs/mhqa.py

For each sampling temperature: the share of train prompts whose 8 samples are mixed, the sampled
success, and the success of rollouts after a trap-hop search that surfaced the needed passage vs a
planted misleading one. Then an offline fit of the predictor head on the prefix features of those
rollouts (70/30 split by prompt), to separate "the features carry no signal" from "online training
does not extract it". Writes --out (default
projects/mhqa/results/warm_start_probe.json).

With --feature_variants, the offline fit is repeated on each feature the head could read
(`trace_jax.diagnostics.FEATURE_VARIANTS`: the last token's final state, as today; the middle
layer's; the final states averaged over the prefix or over the prompt; two concatenations), over
--splits random prompt splits, reporting held-out root and anchor AUC and Brier skill.

With --workdir, the policy probed is a training run's (its latest checkpoint, or --step) instead of
the warm start: how far RL moved the trap-hop wording and what follows it.

  python projects/mhqa/probe_warm_start.py --workdir=runs/compare/default/rollouts/trace-seed0 \
      --temperatures=0.8 --offline_fit=false \
      --out=projects/mhqa/results/policy_probe/trace-seed0.json
"""

import json
import logging
import os
import platform
import sys
import time

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")

from absl import app, flags  # noqa: E402
from absl import logging as absl_logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from launch.seed_stats import stats as _stats  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", os.path.join(_ROOT, "configs", "mhqa.py"),
                                          "configs/mhqa.py[:variant]")
_PROMPTS = flags.DEFINE_integer("prompts", 256, "train prompts probed")
_TEMPS = flags.DEFINE_string("temperatures", "1.0,0.8", "sampling temperatures")
_OUT = flags.DEFINE_string("out", "projects/mhqa/results/warm_start_probe.json", "output JSON")
_VARIANTS = flags.DEFINE_bool(
    "feature_variants", False, "also fit the head offline on each feature variant of "
    "trace_jax.diagnostics.FEATURE_VARIANTS (a teacher-forced forward over every prefix)")
_SPLITS = flags.DEFINE_integer("splits", 5, "random 70/30 prompt splits per feature variant")
_WORKDIR = flags.DEFINE_string("workdir", None, "probe this training run's policy (its "
                               "checkpoint, with its config.json instead of --config) instead of "
                               "the warm start")
_STEP = flags.DEFINE_integer("step", None, "checkpoint step of --workdir (default: the latest)")
_FIT = flags.DEFINE_bool("offline_fit", True, "fit the predictor head offline on the rollouts")


def main(argv):
  del argv
  import numpy as np
  from flax import nnx

  from trace_jax import assets as assets_lib
  from trace_jax.warm_start import warm_start
  from trace_jax.allocation.predictor_fit import PredictorFitter, node_examples
  from trace_jax.allocation.predictor_metrics import predictor_report
  from trace_jax.config import sampler_config
  from trace_jax.diagnostics import classify_failure, failure_breakdown, prefix_signal
  from trace_jax.envs.adapter import TreeEnvAdapter
  from trace_jax.envs.tasks.multihop import MultiHopEnv
  from trace_jax.evaluate import evaluate, sampling_mode
  from trace_jax.models.predictor import PredictorHead
  from trace_jax.rl.batch import tree_metrics
  from trace_jax.rl.update import UpdateConfig, make_optimizers
  from trace_jax.sampling.engine import PromptRequest, SamplerEngine

  logging.getLogger("bm25s").setLevel(logging.WARNING)
  absl_logging.set_verbosity(absl_logging.WARNING)
  from configs import convert, runs

  if _WORKDIR.value:  # the run's own config (world, model, sampling), as it trained
    c = runs.load_run_config(_WORKDIR.value)
  else:
    c = convert.to_train_config(_CONFIG.value)
  assets = assets_lib.load_world_assets(c)
  graphdef, params = nnx.split(assets_lib.build_model(c, assets.vocab_size))
  params, ws = warm_start(c, assets, graphdef, params)
  policy = None
  if _WORKDIR.value:  # a training run's policy, restored as `launch/eval.py` restores it
    from trace_jax.checkpoint import restore_run_policy, run_checkpoint_step
    step = run_checkpoint_step(_WORKDIR.value, _STEP.value)
    params, step = restore_run_policy(c, _WORKDIR.value, step, graphdef, params)
    policy = dict(workdir=_WORKDIR.value, step=step)
  env = MultiHopEnv(assets.retriever, c.env.reward, max_turns=c.env.max_turns,
                    topk=c.retriever.topk)
  scfg = sampler_config(c, num_pages=6 * c.rollout.num_pages)
  engine = SamplerEngine(graphdef, params, scfg, assets.encode, assets.decode,
                         TreeEnvAdapter(env), assets.eos_id,
                         stop_strings=env.stop_strings,
                         observation_close=env.observation_close)
  rng = np.random.default_rng(c.seed)
  probe = [assets.train[i] for i in rng.choice(len(assets.train), _PROMPTS.value, replace=False)]
  out = dict(command="python projects/mhqa/probe_warm_start.py " + " ".join(sys.argv[1:]),
             machine=dict(platform=platform.platform(), cpu_count=os.cpu_count()),
             date=time.strftime("%Y-%m-%d %H:%M:%S"), prompts=len(probe), samples_per_prompt=8,
             warm_start=dict(path=ws.get("path"), steps=ws.get("steps")), policy=policy,
             temperatures={})
  # greedy, as the training run's step-0 eval; its trees say why each question failed
  ev = evaluate(engine, assets.test[:c.eval.size], keep_trees=True)
  trees = ev["trees"]
  out["greedy"] = dict(em=ev["em"], f1=ev["f1"], n=ev["n"], em_by_hops=ev["em_by_hops"])
  out["greedy"]["outcomes"] = failure_breakdown(trees, assets.world)
  out["greedy"]["by_hops"] = _by_hops(trees, assets.world)
  out["greedy"]["by_seen"] = {  # the question's entity appears in a train question, or not
      k: dict(questions=len(sub), outcomes=failure_breakdown(sub, assets.world))
      for k, sub in (("seen", [t for t in trees if t.meta.get("entity_seen")]),
                     ("unseen", [t for t in trees if not t.meta.get("entity_seen")])) if sub}
  out["greedy"]["per_question"] = {  # to follow each question from one policy to another
      t.meta["id"]: classify_failure(t, t.leaves()[0].id, assets.world) or "success"
      for t in trees}
  print("greedy", json.dumps(out["greedy"]), flush=True)
  for temp in map(float, _TEMPS.value.split(",")):
    with sampling_mode(engine, temperature=temp):
      trees = engine.run([PromptRequest(e["prompt_ids"], 8, meta=e) for e in probe])
    tm = tree_metrics(trees)
    res = dict(mixed_share=tm["effective_ratio"], sampled_success=tm["reward_mean"],
               **prefix_signal(trees, assets.world))
    res["outcomes"] = failure_breakdown(trees, assets.world)
    res["by_hops"] = _by_hops(trees, assets.world)
    # offline predictor fit on this temperature's rollouts
    if _FIT.value and temp == c.rollout.temperature:
      tx = make_optimizers(UpdateConfig(predictor_lr=c.rl.predictor_lr))[1]

      def offline_fit(train, held):
        d = next(n.feature for t in train for n in t.nodes if n.feature is not None).shape[-1]
        head = PredictorHead(d, c.model.predictor_hidden, rngs=nnx.Rngs(c.seed + 1))
        hg, hs = nnx.split(head)
        fitter = PredictorFitter(hg, tx, steps=300, buffer_steps=1, max_rows=10**6)
        fitter.add(train)
        hs, _, info = fitter.fit(hs, tx.init(hs))
        x, y = node_examples(held)
        p = np.asarray(nnx.merge(hg, hs).prob(x))
        kinds = np.asarray([_kind(n) for t in held for n in t.nodes
                            if n.feature is not None and n.value is not None])
        # Each root's p̂ against each of its rollouts' outcomes, as the training run's online
        # metrics score it (the reports above score V(root), the mean of 8 outcomes, above 0.5).
        p_root = np.asarray(nnx.merge(hg, hs).prob(np.stack([t.root.feature for t in held])))
        single = [(pr, float(leaf.reward or 0.0) > 0.5) for pr, t in zip(p_root, held)
                  for leaf in t.leaves()]
        return dict(
            train_rows=info.get("predictor_fit_rows"), heldout=predictor_report(p, y > 0.5),
            # What allocation reads: roots (stage 1) and internal turn boundaries (stage 2).
            **{f"heldout_{k}": predictor_report(p[kinds == k], y[kinds == k] > 0.5)
               for k in ("root", "anchor")},
            heldout_root_single=predictor_report(*map(np.asarray, zip(*single))))

      split = int(0.7 * len(trees))
      res["offline_predictor"] = offline_fit(trees[:split], trees[split:])
      if _VARIANTS.value:
        res["feature_variants"] = _variant_fits(graphdef, params, trees, split, offline_fit)
    out["temperatures"][str(temp)] = res
    engine.release(trees)
    print(temp, json.dumps(res, default=float), flush=True)
  os.makedirs(os.path.dirname(_OUT.value), exist_ok=True)
  with open(_OUT.value, "w") as f:
    json.dump(out, f, indent=1, default=float)


def _by_hops(trees, world) -> dict:
  """Per hop count: prompts, their mixed share over the 8 samples, sampled success, and the trap
  signal (`prefix_signal`) of the rollouts that made a trap-hop search."""
  from trace_jax.diagnostics import failure_breakdown, prefix_signal
  from trace_jax.rl.batch import tree_metrics

  out = {}
  for hops in sorted({int(t.meta["hops"]) for t in trees}):
    sub = [t for t in trees if int(t.meta["hops"]) == hops]
    tm = tree_metrics(sub)
    out[str(hops)] = dict(prompts=len(sub), sampled_success=tm["reward_mean"],
                          **prefix_signal(sub, world), outcomes=failure_breakdown(sub, world))
    if any(len(t.leaves()) > 1 for t in sub):  # groups, not single (greedy) rollouts
      out[str(hops)]["mixed_share"] = tm["effective_ratio"]
  return out


# Training-set sizes (prompts) for the learning curve: the run's warm-start probe fits the head on
# 32 prompts before RL, and a step adds 16 to 48 scored prompts.
LEARNING_CURVE_PROMPTS = (16, 32, 64, 128)
LEARNING_CURVE_VARIANTS = ("final_last", "final_last+prompt_mean")


def _mean_std(vals) -> dict:
  """Mean and sample std of the finite values (NaN for both when there are none)."""
  s = _stats(vals)
  return dict(mean=s["mean"], std=s["std"]) if s else dict(mean=float("nan"), std=float("nan"))


def _variant_fits(graphdef, params, trees, split, offline_fit) -> dict:
  """The offline fit on each feature variant over `--splits` random prompt splits: per variant,
  the held-out root and anchor AUC and Brier skill (mean, std over splits and each split's)."""
  import numpy as np

  from trace_jax.diagnostics import FEATURE_VARIANTS, feature_variants

  feats = feature_variants(graphdef, params, trees)
  recorded = {(ti, n.id): n.feature for ti, t in enumerate(trees) for n in t.nodes
              if n.feature is not None}
  # The teacher-forced final_last must be the feature the sampler recorded during decoding.
  gap = max(float(np.abs(feats["final_last"][k] - f).max()) for k, f in recorded.items())
  out = dict(recorded_vs_teacher_forced_max_abs=gap, splits=_SPLITS.value, variants={})
  rng = np.random.default_rng(1234)
  orders = [rng.permutation(len(trees)) for _ in range(_SPLITS.value)]
  try:
    for v in FEATURE_VARIANTS:
      for (ti, nid), f in feats[v].items():
        trees[ti].nodes[nid].feature = f
      per = []
      for order in orders:
        r = offline_fit([trees[i] for i in order[:split]], [trees[i] for i in order[split:]])
        per.append({f"{k}_{m}": r[f"heldout_{k}"][m] for k in ("root", "anchor", "root_single")
                    for m in ("auc", "brier_skill", "n")})
      stats = {k: _mean_std([p[k] for p in per]) for k in per[0]}
      out["variants"][v] = dict(dim=int(next(iter(feats[v].values())).shape[-1]), **stats,
                                per_split=per)
      print(v, json.dumps({k: round(s["mean"], 3) for k, s in stats.items()}), flush=True)
      if v in LEARNING_CURVE_VARIANTS:  # how many training prompts the head needs
        curve = {}
        for n_train in (n for n in LEARNING_CURVE_PROMPTS if n < split):
          aucs = {k: [] for k in ("root_single", "anchor")}
          for order in orders:
            r = offline_fit([trees[i] for i in order[:n_train]], [trees[i] for i in order[split:]])
            for k in aucs:
              aucs[k].append(r[f"heldout_{k}"]["auc"])
          curve[str(n_train)] = {f"{k}_auc": _mean_std(a) for k, a in aucs.items()}
          print(v, n_train, "train prompts", json.dumps(
              {k: round(x["mean"], 3) for k, x in curve[str(n_train)].items()}), flush=True)
        out["variants"][v]["learning_curve"] = curve
  finally:
    for (ti, nid), f in recorded.items():
      trees[ti].nodes[nid].feature = f
  return out


def _kind(node) -> str:
  if node.parent < 0:
    return "root"
  return "leaf" if node.done else "anchor"


if __name__ == "__main__":
  app.run(main)
