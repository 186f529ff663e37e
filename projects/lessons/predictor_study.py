"""How well can the success predictor tell, before sampling, which prompts will be mixed?

Stage 1 of trace_tree reads p̂ of each candidate prompt and spends its rollouts on the prompts
whose groups it expects to be mixed. On the lessons world its trees came out mixed *less* often
than GRPO's uniform groups (projects/lessons/README.md), while the runs logged p̂'s AUC on a
random slice near 0.6. This study asks why, offline, on one policy at a time:

  python projects/lessons/predictor_study.py --run=runs/.../trace_tree-seed0 --step=90 \
      --out=projects/lessons/results/predictor_study/w3-ws0-trace_paper-seed0.json

For the run's warm start and for its checkpoint at `--step` (the run's own config.json, a scratch
workdir), it samples `--group` rollouts on each of `--prompts` train prompts (temperature of the
run), then fits the predictor head the way the run does (`PredictorFitter`: visits weighting,
Adam at `rl.predictor_lr`, starting from the head the policy came with) on the trees of the first
`--fit_prompts` prompts, under several fit settings, and scores each on the remaining prompts:

- `auc`: p̂ of a prompt against each of its rollouts' outcomes (what the runs log as slice_auc);
- `corr`: Pearson correlation of p̂ with the prompt's success rate over its `--group` rollouts;
- stage 1's own choice on `--pools` random pools of `candidate_prompts` held-out prompts
  (`allocate_roots_subset`, the run's budget and bounds, the paper objective): the share of
  selected trees that are mixed, and of stage-1 rollouts that sit in mixed trees, each computed
  *exactly unbiased* from the prompt's `--group` samples (the chance that m of them drawn without
  replacement are mixed; m never exceeds `--group`), beside GRPO's uniform choice (the step's
  prompts at `root_budget / prompts_per_step` rounded, and at 8 each).

References beside the fits: `run_head` (the head the checkpoint holds, as the run left it),
`lesson_mean` (each prompt's lesson's mean success over the fit prompts: a predictor that knew the
world's lesson labels, which the method does not), and `own_rate` (the prompt's own rate: the
selection's ceiling, in-sample). And one the method could use: `knn{K}_fit{N}` (the mean rate of
the K fit prompts nearest in cosine of the root features the head reads, shrunk to the prior), with
the share of those neighbours that carry the prompt's own lesson: whether the features place
prompts of one lesson together, apart from whether a small head can be fit to them.
"""

import json
import math
import os
import time

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402


def mixed_prob(k, n, m):
  """Unbiased estimate of P(m fresh rollouts are mixed) from k successes among n samples (m <= n):
  the chance that m of the n drawn without replacement hold both outcomes. Vectorized over k, m."""
  comb = np.vectorize(math.comb, otypes=[np.float64])
  k, m = np.broadcast_arrays(np.asarray(k, np.int64), np.asarray(m, np.int64))
  c = comb(n, m)
  out = 1.0 - comb(k, m) / c - comb(n - k, m) / c
  return np.where(m > 0, out, 0.0)


def knn_predict(fit_feats, fit_rates, test_feats, k, prior, strength=2.0):
  """p̂ of each test prompt from the `k` fit prompts nearest in cosine similarity of their root
  features: the mean of their success rates, shrunk toward `prior` by `strength` pseudo-prompts.
  Non-parametric: it asks whether the features the head reads place prompts that succeed alike
  near each other, apart from whether a small head can be fit to them."""
  if not 1 <= k <= len(fit_feats):
    raise ValueError(f"k={k} must be in [1, {len(fit_feats)}] (the fit prompts)")
  a = np.asarray(fit_feats, np.float64)
  b = np.asarray(test_feats, np.float64)
  a = a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)
  b = b / np.maximum(np.linalg.norm(b, axis=1, keepdims=True), 1e-12)
  near = np.argsort(-(b @ a.T), axis=1, kind="stable")[:, :k]
  rates = np.asarray(fit_rates, np.float64)[near]
  return (rates.sum(1) + strength * prior) / (k + strength), near


def neighbour_purity(near, fit_labels, test_labels):
  """Share of each test prompt's neighbours (indices into the fit prompts) that carry its label,
  averaged; beside it, the share a random draw of fit prompts would give."""
  fit_labels = np.asarray(fit_labels)
  test_labels = np.asarray(test_labels)
  same = fit_labels[near] == test_labels[:, None]
  chance = np.mean([np.mean(fit_labels == t) for t in test_labels])
  return float(same.mean()), float(chance)


def implied_concentration(p_hat, k, n):
  """κ at which Beta(κ p̂, κ (1 - p̂)) has the spread of the prompts' true rates about p̂, pooled:
  Σ p̂(1 - p̂) / Σ (p - p̂)² - 1, with (p - p̂)² estimated without bias from k of n samples,
  (k/n - p̂)² - k(n - k) / (n²(n - 1)). Large: p̂ is each prompt's rate (the paper objective's
  premise); small: p̂ is a mean over prompts whose rates sit far from it (inf if none do)."""
  p_hat = np.asarray(p_hat, np.float64)
  k = np.asarray(k, np.float64)
  sq = (k / n - p_hat) ** 2 - k * (n - k) / (n * n * (n - 1))
  spread = float(np.sum(sq))
  return float(np.sum(p_hat * (1 - p_hat)) / spread - 1) if spread > 0 else float("inf")


def binned_mixed_table(p_fit, k_fit, n, p_test, counts, bins=8):
  """Stage 1's value table read off outcomes instead of V_root(p̂): the fit prompts are cut into
  `bins` quantile bins of p̂, and the value of m rollouts for a test prompt is its bin's mean of
  the exact chance that m of the fit prompt's n samples are mixed (`mixed_prob`). Selection by p̂
  alone is ignorable given p̂, so a run's own trees would give these estimates without bias.
  f32[len(p_test), len(counts)]."""
  p_fit, p_test = np.asarray(p_fit, np.float64), np.asarray(p_test, np.float64)
  if max(counts) > n:
    raise ValueError(f"counts up to {max(counts)} need at least that many samples, have {n}")
  edges = np.quantile(p_fit, np.linspace(0, 1, bins + 1)[1:-1])
  fit_bin, test_bin = np.searchsorted(edges, p_fit), np.searchsorted(edges, p_test)
  k_fit = np.asarray(k_fit)
  table = np.zeros((bins, len(counts)))
  for b in range(bins):
    kb = k_fit[fit_bin == b]
    for j, m in enumerate(counts):
      table[b, j] = mixed_prob(kb, n, np.full(len(kb), m)).mean() if len(kb) else 0.0
  return table[test_bin].astype(np.float32)


def selection(p_hat, k, n, rng, pools, c, concentration=None, table=None):
  """Stage 1 on random pools of the held-out prompts: mixed share of selected trees and of their
  rollouts (estimated exactly from the samples), with the uniform choices beside them. With
  `concentration` κ the choice maximizes the posterior objective (E[V_root] under
  p ~ Beta(κ p̂, κ (1 - p̂))) instead of the paper's V_root(p̂); with `table` (f32[N, K] over
  every prompt and the counts min..max per prompt) it maximizes that table."""
  import jax.numpy as jnp

  from trace_jax.allocation.allocators import allocate_roots_subset as alloc
  from trace_jax.allocation.allocators import root_value_table

  r = c.rollout
  P, sel = r.candidate_prompts, r.prompts_per_step
  counts = tuple(range(r.min_per_prompt, r.max_per_prompt + 1))
  even = max(1, round(r.root_budget / sel))
  trees, rollouts, uni, uni8 = [], [], [], []
  for _ in range(pools):
    idx = rng.choice(len(k), P, replace=False)
    pool = jnp.asarray(p_hat[idx], jnp.float32)
    values = (None if concentration is None
              else root_value_table(pool, counts, "posterior", concentration))
    if table is not None:
      values = jnp.asarray(table[idx], jnp.float32)
    m = np.asarray(alloc(pool, r.root_budget, sel, r.min_per_prompt, r.max_per_prompt, values))
    chosen = m > 0
    q = mixed_prob(k[idx][chosen], n, m[chosen])
    trees.append(q.mean())
    rollouts.append((q * m[chosen]).sum() / m[chosen].sum())
    u = idx[:sel]  # a uniform choice of the step's prompts
    uni.append(mixed_prob(k[u], n, np.full(sel, even)).mean())
    uni8.append(mixed_prob(k[u], n, np.full(sel, min(8, n))).mean())
  return dict(selected_trees_mixed=float(np.mean(trees)),
              selected_rollouts_in_mixed=float(np.mean(rollouts)),
              uniform_trees_mixed=float(np.mean(uni)), uniform_per_prompt=even,
              uniform8_trees_mixed=float(np.mean(uni8)))


POSTERIOR_KAPPAS = (2.0, 8.0)  # stage 1 also scored under the posterior objective at these κ


def score(p_hat, k, n, seed, pools, c, table=None):
  """A predictor's AUC, Brier, correlation with the rates and implied κ on the held-out prompts,
  and stage 1's choice under it on `pools` random pools drawn from `seed` (the paper objective,
  then the posterior one at each of POSTERIOR_KAPPAS on the same pools)."""
  from trace_jax.allocation.predictor_metrics import auc, brier

  y = np.concatenate([np.r_[np.ones(int(ki)), np.zeros(n - int(ki))] for ki in k])
  p = np.repeat(p_hat, n)
  rate = k / n
  corr = float(np.corrcoef(p_hat, rate)[0, 1]) if np.std(p_hat) > 0 else float("nan")
  out = dict(auc=auc(p, y), brier=brier(p, y), corr=corr, p_hat_mean=float(np.mean(p_hat)),
             p_hat_std=float(np.std(p_hat)), implied_kappa=implied_concentration(p_hat, k, n),
             **selection(p_hat, k, n, np.random.default_rng(seed), pools, c, table=table))
  for kappa in POSTERIOR_KAPPAS:  # the same pools (same seed), chosen by the posterior objective
    pick = selection(p_hat, k, n, np.random.default_rng(seed), pools, c, kappa)
    out[f"selected_trees_mixed_posterior{kappa:g}"] = pick["selected_trees_mixed"]
  return out


def sample(run, params, examples, group):
  """Trees of `group` rollouts per example under `params`; (trees, successes per prompt)."""
  from trace_jax.sampling.engine import PromptRequest

  run.engine.update_params(params)
  per = max(1, run.c.rollout.prompts_per_step)
  trees, k = [], []
  for i in range(0, len(examples), per):
    chunk = examples[i:i + per]
    got = run.engine.run([PromptRequest(e["prompt_ids"], group, meta=e) for e in chunk])
    for t in got:
      k.append(int(round(sum(float(leaf.reward or 0.0) for leaf in t.leaves()))))
    trees += got
    run.engine.release(got)
  return trees, np.asarray(k)


def fit_head(run, pred0, trees, steps, roots_only):
  from trace_jax.allocation.predictor_fit import PredictorFitter
  from trace_jax.config import update_config
  from trace_jax.rl.update import make_optimizers

  c = run.c
  fitter = PredictorFitter(run.pred_graphdef, make_optimizers(update_config(c))[1], steps=steps,
                           buffer_steps=1, root_buffer_steps=1, seed=c.seed,
                           weighting=c.rl.predictor_weighting, pred_state=pred0)
  fitter.add(trees)
  if roots_only:  # the turn-boundary rows weigh nothing: the fit sees prompts only
    x, y, w, leaf, held = fitter.buffer[0]
    fitter.buffer[0] = (x, y, np.zeros_like(w), leaf, held)
  state, info = fitter.fit(pred0)
  return fitter, state, info


def study(run, params, pred_state, examples, label, has_head):
  c, n = run.c, _GROUP.value
  t0 = time.time()
  trees, k = sample(run, params, examples, n)
  t_sample = time.time() - t0
  n_fit_max = max(int(v) for v in _FIT.value)
  test = slice(n_fit_max, None)
  feats = np.stack([np.asarray(t.root.feature, np.float32) for t in trees])
  k_test = k[test]
  out = dict(condition=label, prompts=len(examples), group=n, sample_seconds=t_sample,
             success=float(k.sum() / (n * len(k))),
             mixed_share_group=float(np.mean((k > 0) & (k < n))),
             test_prompts=int(len(k_test)), predictors={})
  rng_seed = _SEED.value + 1

  def add(name, p_hat, table=None, **extra):
    out["predictors"][name] = dict(score(np.asarray(p_hat, np.float64), k_test, n,
                                         rng_seed, _POOLS.value, c, table),
                                   **extra)
    s = out["predictors"][name]
    print(f"[{label}] {name:28s} auc {s['auc']:.3f} corr {s['corr']:+.3f} p̂ {s['p_hat_mean']:.2f}"
          f"±{s['p_hat_std']:.2f}  selected mixed {s['selected_trees_mixed']:.3f} (rollouts "
          f"{s['selected_rollouts_in_mixed']:.3f}) uniform {s['uniform_trees_mixed']:.3f} / "
          f"8 each {s['uniform8_trees_mixed']:.3f}; implied κ {s['implied_kappa']:.1f}, posterior "
          + " ".join(f"κ={kp:g} {s[f'selected_trees_mixed_posterior{kp:g}']:.3f}"
                     for kp in POSTERIOR_KAPPAS), flush=True)

  from trace_jax.allocation.predictor_fit import PredictorFitter  # noqa: F401  (spread below)
  probe, _, _ = fit_head(run, pred_state, trees[:1], 1, False)  # for `spread` only
  from trace_jax.allocation.allocators import binned_root_beta, root_value_table

  counts = tuple(range(c.rollout.min_per_prompt, c.rollout.max_per_prompt + 1))

  def add_with_bins(name, state, nf, **extra):
    """The head's p̂ as the paper objective reads it, then through `binned_mixed_table` fit on the
    first `nf` prompts' outcomes (a bin per 24 prompts, at least 2)."""
    p_test = probe.spread(state, feats[test])[0]
    add(name, p_test, **extra)
    p_fit = probe.spread(state, feats[:nf])[0]
    bins = max(2, nf // 24)
    table = binned_mixed_table(p_fit, k[:nf], n, p_test, counts, bins=bins)
    add(name + "_binned", p_test, table=table)
    # The run's version (`rollout.root_objective=binned`): a Beta per bin by moments.
    mu, kappa = binned_root_beta(p_fit, k[:nf], np.full(nf, n), p_test, bins=bins)
    add(name + "_binned_beta", p_test,
        table=np.asarray(root_value_table(mu, counts, "binned", kappa), np.float32))

  if has_head:
    add_with_bins("run_head", pred_state, n_fit_max)
  for nf in (int(v) for v in _FIT.value):
    for steps in (int(v) for v in _STEPS.value):
      for roots_only in (False, True):
        _, st, info = fit_head(run, pred_state, trees[:nf], steps, roots_only)
        name = f"fit{nf}_steps{steps}" + ("_roots" if roots_only else "")
        add_with_bins(name, st, nf, fit_rows=info.get("predictor_fit_rows"))
  # References the method has no access to.
  lesson = [tuple(e.get("groups") or ()) for e in examples]
  fit_idx = range(n_fit_max)
  sums = {}
  for i in fit_idx:
    a = sums.setdefault(lesson[i], [0, 0])
    a[0] += k[i]
    a[1] += n
  prior = float(k[:n_fit_max].sum()) / (n * n_fit_max)
  lm = [(sums.get(lesson[i], [0, 0])[0] + 2 * prior) / (sums.get(lesson[i], [0, 0])[1] + 2)
        for i in range(n_fit_max, len(examples))]
  add("lesson_mean", lm)
  lesson_id = {g: j for j, g in enumerate(sorted(set(lesson)))}
  labels = np.asarray([lesson_id[g] for g in lesson])
  for nf in (int(v) for v in _FIT.value):
    for kk in (8, 32):
      if kk > nf:
        continue
      p_knn, near = knn_predict(feats[:nf], k[:nf] / n, feats[test], kk, prior)
      purity, chance = neighbour_purity(near, labels[:nf], labels[test])
      add(f"knn{kk}_fit{nf}", p_knn, lesson_purity=purity, lesson_purity_chance=chance)
      print(f"[{label}] knn{kk}_fit{nf}: neighbours sharing the prompt's lesson {purity:.3f} "
            f"(chance {chance:.3f})", flush=True)
  add("own_rate", k_test / n)
  add("constant", np.full(len(k_test), prior))
  return out


def plot(results, path):
  """Per condition (a row): each predictor's AUC, and the share of stage 1's selected trees that
  are mixed beside the uniform choices at stage 1's count and at 8 per prompt."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return False
  rows = max(len(r["predictors"]) for r in results)
  fig, axes = plt.subplots(len(results), 2, figsize=(12, 0.9 + 0.24 * rows * len(results)),
                           squeeze=False, sharey="row")
  for j, res in enumerate(results):
    preds = res["predictors"]
    names = list(preds)
    ax = axes[j, 0]
    ax.barh(names, [preds[n]["auc"] for n in names], color="C0")
    ax.axvline(0.5, c="gray", ls="--")
    ax.set(xlim=(0.4, 1.0), xlabel="AUC on held-out prompts' rollouts", title=res["condition"])
    ax.invert_yaxis()
    ax = axes[j, 1]
    ax.barh(names, [preds[n]["selected_trees_mixed"] for n in names], color="C1",
            label="stage 1's selected trees")
    u = preds[names[0]]
    ax.axvline(u["uniform_trees_mixed"], c="k", ls="--",
               label=f"uniform, {u['uniform_per_prompt']} each")
    ax.axvline(u["uniform8_trees_mixed"], c="gray", ls=":", label="uniform, 8 each")
    ax.set(xlim=(0, 1), xlabel="share of trees mixed", title=res["condition"])
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def main(argv):
  del argv
  import dataclasses

  from configs import runs
  from trace_jax import train as T
  from trace_jax.checkpoint import Checkpointer, restore_target, run_checkpoint_step
  from trace_jax.config import TrainConfig

  d = runs.load_run_config_dict(_RUN.value)
  d["workdir"] = _WORKDIR.value
  c = TrainConfig.from_dict(d)
  if _GROUP.value < c.rollout.max_per_prompt:
    raise ValueError(f"--group={_GROUP.value} must be >= rollout.max_per_prompt="
                     f"{c.rollout.max_per_prompt} (the estimate draws m of the group's samples)")
  if max(int(v) for v in _FIT.value) >= _PROMPTS.value - c.rollout.candidate_prompts:
    raise ValueError("--prompts leaves fewer held-out prompts than a candidate pool")
  run = T.build(dataclasses.replace(c))
  rng = np.random.default_rng(_SEED.value)
  pool = run.assets.train
  examples = [pool[int(i)] for i in rng.choice(len(pool), _PROMPTS.value, replace=False)]
  results = [study(run, T.policy_params(run.init_params, c.model.param_dtype),
                   run.init_pred_params, examples, "warm start", False)]
  step = run_checkpoint_step(_RUN.value, _STEP.value)
  ckpt = Checkpointer(os.path.join(_RUN.value, "checkpoints"), max_to_keep=10**6)
  state, _ = ckpt.restore(restore_target(c, run.graphdef, run.init_params), step)
  ckpt.close()
  results.append(study(run, T.policy_params(state["params"], c.model.param_dtype),
                       state["pred_params"], examples, f"step {step}", True))
  out = dict(run=_RUN.value, step=step, world_seed=c.world.seed, method=c.method,
             flags=dict(prompts=_PROMPTS.value, group=_GROUP.value, fit_prompts=_FIT.value,
                        fit_steps=_STEPS.value, pools=_POOLS.value, seed=_SEED.value),
             conditions=results)
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  with open(_OUT.value, "w") as f:
    json.dump(out, f, indent=1)
  png = os.path.splitext(_OUT.value)[0] + ".png"
  print(f"wrote {_OUT.value}" + (f" and {png}" if plot(results, png) else ""))


if __name__ == "__main__":
  # Flags defined here, not at import: tests import this module beside other scripts.
  _RUN = flags.DEFINE_string("run", None, "a training run's workdir (its config.json, checkpoints)",
                             required=True)
  _STEP = flags.DEFINE_integer("step", None, "the checkpoint step (default: the latest)")
  _PROMPTS = flags.DEFINE_integer("prompts", 480, "train prompts sampled")
  _GROUP = flags.DEFINE_integer("group", 12, "rollouts per prompt (>= rollout.max_per_prompt)")
  _FIT = flags.DEFINE_list("fit_prompts", ["64", "192"], "prompts whose trees the head is fit on "
                           "(the first N; 64 = the run's 4-step root buffer)")
  _STEPS = flags.DEFINE_list("fit_steps", ["50", "300"], "Adam steps of each fit")
  _POOLS = flags.DEFINE_integer("pools", 300, "random candidate pools scored per predictor")
  _OUT = flags.DEFINE_string("out", "projects/lessons/results/predictor_study/study.json",
                             "the results file (a .png beside it)")
  _WORKDIR = flags.DEFINE_string("workdir", "/tmp/predictor_study", "scratch workdir")
  _SEED = flags.DEFINE_integer("seed", 0, "prompt draw and pool draws")
  app.run(main)
