"""The TRACE training loop as a library: `train(config) -> summary`.

Sections: setup (workdir, mesh) -> data and model -> warm start -> sampler and driver -> update
step -> checkpoint/resume -> loop (sample, batch, update, evaluate) -> summary and plots.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from trace_jax import assets as assets_lib
from trace_jax.checkpoint import Checkpointer
from trace_jax.diagnostics import prefix_signal
from trace_jax.envs.env import MultiHopEnv
from trace_jax.evaluate import evaluate
from trace_jax.metrics import MetricWriter, format_summary, plot_run, read_jsonl
from trace_jax.models.predictor import PredictorHead
from trace_jax.parallel import initialize, make_mesh, shard_batch, shard_state
from trace_jax.rl.batch import build_sequences, pack_batch, tree_metrics
from trace_jax.rl.predictor_metrics import calibration_curve, predictor_report
from trace_jax.rl.predictor_fit import PredictorFitter
from trace_jax.rl.update import (UpdateConfig, init_train_state, jit_update_step,
                                 make_optimizers)
from trace_jax.rollout import strategies
from trace_jax.rollout.driver import DriverConfig, RolloutDriver, dapo_prompts
from trace_jax.rollout.env_adapter import TreeEnvAdapter
from trace_jax.rollout.sampler import SamplerEngine
from trace_jax.rollout.sampler_config import sampler_config_from

log = logging.getLogger(__name__)


def _bucket(n: int, multiple: int) -> int:
  return max(multiple, -(-n // multiple) * multiple)


def make_predictor(pred_graphdef):
  """Jitted p̂ from features [N, D], padded to buckets of 64 rows (one compile per bucket)."""
  @jax.jit
  def _probs(pred_state, feats):
    return nnx.merge(pred_graphdef, pred_state).prob(feats)

  def predict(pred_state, feats):
    feats = np.asarray(feats, np.float32)
    n = feats.shape[0]
    pad = np.zeros((_bucket(n, 64), feats.shape[1]), np.float32)
    pad[:n] = feats
    return np.asarray(_probs(pred_state, pad))[:n]

  return predict


def _workdir(c) -> str:
  if c.workdir:
    return c.workdir
  return os.path.join("runs", f"{c.variant}-{c.method}-seed{c.seed}-{time.strftime('%Y%m%d-%H%M%S')}")


def train(c, validate_fn=None) -> dict:
  """Runs warm start (synthetic world) and RL with the configured method; returns the summary."""
  t_start = time.time()
  if validate_fn is not None:
    validate_fn(c)
  # ---- setup ------------------------------------------------------------------------------------
  initialize()
  workdir = _workdir(c)
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(c.to_json_best_effort(indent=1))
  mesh = make_mesh(c.mesh)
  writer = MetricWriter(workdir)
  rng = np.random.default_rng(c.seed)

  # ---- data and model ---------------------------------------------------------------------------
  synthetic = not c.variant.startswith("qwen3")
  assets = assets_lib.load_world_assets(c) if synthetic else assets_lib.load_real_assets(c)
  model = assets_lib.build_model(c, assets.vocab_size, mesh if c.model.path else None)
  graphdef, params = nnx.split(model)
  head = PredictorHead(model.cfg.hidden_size, c.model.predictor_hidden, rngs=nnx.Rngs(c.seed + 1))
  pred_graphdef, pred_params = nnx.split(head)
  print(f"[trace_jax] workdir {workdir}; model {sum(x.size for x in jax.tree.leaves(params)):,} "
        f"params; {len(assets.train)} train / {len(assets.test)} test prompts", flush=True)

  # ---- warm start -------------------------------------------------------------------------------
  ws_info = {}
  if synthetic:
    def ws_log(i, m):
      writer.write(-1, {f"sft_{k}": v for k, v in m.items()})
    params, ws_info = assets_lib.warm_start(c, assets, graphdef, params, ws_log)
    how = "restored from the cache" if ws_info.get("cached") else "trained"
    print(f"[trace_jax] warm start {how} ({ws_info.get('steps')} steps trained in "
          f"{ws_info.get('seconds', 0):.0f}s)", flush=True)

  # ---- sampler, environment and driver ----------------------------------------------------------
  env = MultiHopEnv(assets.retriever, c.env.reward, max_turns=c.env.max_turns,
                    topk=c.retriever.topk)
  r = c.rollout
  scfg = sampler_config_from(c)
  engine = SamplerEngine(graphdef, params, scfg, assets.encode, assets.decode,
                         TreeEnvAdapter(env, golds_key="answers"), assets.eos_id)
  predict = make_predictor(pred_graphdef)
  holder = {"pred": pred_params}  # the driver reads the predictor's latest state
  dcfg = DriverConfig(method=c.method, root_budget=r.root_budget, prefix_budget=r.prefix_budget,
                      min_per_prompt=r.min_per_prompt, max_per_prompt=r.max_per_prompt,
                      prompts_per_step=r.prompts_per_step,
                      max_per_anchor=r.max_per_anchor, budget_unit=r.budget_unit,
                      tree_lambda=r.tree_lambda, blend_prior=r.blend_prior,
                      dapo_oversample=r.dapo_oversample, arpo_entropy_top=r.arpo_entropy_top)
  driver = RolloutDriver(engine, dcfg, lambda f: predict(holder["pred"], f),
                         engine.prompt_features, seed=c.seed)

  # ---- update step ------------------------------------------------------------------------------
  ucfg = UpdateConfig(lr=c.rl.lr, predictor_lr=c.rl.predictor_lr, eps_low=c.rl.eps_low,
                      eps_high=c.rl.eps_high, kl_coef=c.rl.kl_coef,
                      entropy_coef=c.rl.entropy_coef, max_grad_norm=c.rl.max_grad_norm,
                      micro_batches=c.rl.micro_batches, temperature=1.0)
  dp = mesh.shape["data"] * mesh.shape["fsdp"]
  if mesh.size > 1:  # parameters born in their logical sharding; optimizer states follow them
    params = shard_state(params, mesh)
  state = init_train_state(params, pred_params, ucfg)
  update = jit_update_step(graphdef, pred_graphdef, ucfg)
  fitter = PredictorFitter(pred_graphdef, make_optimizers(ucfg)[1], steps=c.rl.predictor_fit_steps,
                           buffer_steps=c.rl.predictor_buffer_steps, seed=c.seed,
                           weighting=c.rl.predictor_weighting,
                           root_buffer_steps=c.rl.predictor_root_buffer_steps,
                           root_features=functools.partial(engine.prompt_features,
                                                           count_prefill=False)
                           if c.rl.predictor_refresh_roots else None)

  def fit_predictor(trees, steps=None):
    fitter.add(trees)
    if not c.rl.predictor_fit_steps:
      return {}
    ps, po, info = fitter.fit(state["pred_params"], state["pred_opt"], steps)
    state["pred_params"], state["pred_opt"] = ps, po
    holder["pred"] = ps
    return info
  ref_params = jax.tree.map(jnp.copy, params) if c.rl.kl_coef > 0 else None

  # ---- checkpoint / resume ----------------------------------------------------------------------
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), max_to_keep=c.ckpt.max_to_keep)
  start, meta = 0, {}
  if ckpt.latest_step() is not None:
    state, meta = ckpt.restore(state)
    start = int(meta["step"])
    print(f"[trace_jax] resumed at step {start} from {ckpt.directory}", flush=True)
  totals = dict(meta.get("totals", {"generated_tokens": 0, "rollouts": 0, "prefill_tokens": 0,
                                    "tool_calls": 0}))
  predictions = list(meta.get("predictions", []))
  holder["pred"] = state["pred_params"]
  engine.update_params(state["params"])

  def run_eval(step):
    n = min(c.eval.size, len(assets.test))
    res = evaluate(engine, assets.test[:n])
    rec = {"eval_em": res["em"], "eval_f1": res["f1"], "eval_turns": res["mean_turns"],
           "generated_tokens_total": totals["generated_tokens"]}
    rec.update({f"eval_em_hops{h}": v for h, v in res["em_by_hops"].items()})
    writer.write(step, rec)
    return res

  evals = meta.get("evals", {})
  if start == 0 and "0" not in evals:
    res = run_eval(0)
    evals["0"] = res["em"]
    print(f"[trace_jax] greedy EM before RL: {res['em']:.3f} by hops {res['em_by_hops']}",
          flush=True)
    if synthetic:  # does a misleading search really lower what follows? (warm-started policy)
      probe = [assets.train[i]
               for i in rng.choice(len(assets.train), c.eval.probe_prompts, replace=False)]
      from trace_jax.rollout.sampler import PromptRequest
      trees = engine.run([PromptRequest(e["prompt_ids"], 8, meta=e) for e in probe])
      sig = prefix_signal(trees, assets.world)
      tm0 = tree_metrics(trees)
      sig["mixed_share_8"], sig["sampled_success"] = tm0["effective_ratio"], tm0["reward_mean"]
      # The probe's rollouts also give the predictor a head start before its first allocation.
      sig.update(fit_predictor(trees, steps=c.rl.predictor_warm_steps))
      engine.release(trees)
      meta["warm_start_probe"] = sig
      writer.write(0, {f"probe_{k}": v for k, v in sig.items()})
      print(f"[trace_jax] warm-start probe: {json.dumps(sig)}", flush=True)

  # ---- loop -------------------------------------------------------------------------------------
  order = rng.permutation(len(assets.train))
  bar = tqdm(range(start, c.rl.steps), desc=f"RL ({c.method})", initial=start, total=c.rl.steps)
  er_hist = list(meta.get("er_hist", []))
  n_prompts = step_prompts(c)
  for step in bar:
    t0 = time.time()
    idx = [order[(step * n_prompts + j) % len(order)] for j in range(n_prompts)]
    examples = [assets.train[i] for i in idx]
    use_pred = step >= c.rl.predictor_warmup_steps
    sample = driver.sample(examples, use_predictor=use_pred)
    t_sample = time.time() - t0
    if use_pred:
      predictions += [list(p) for p in sample.predictions]
    tm = tree_metrics(sample.all_trees)
    er_hist.append(tm["effective_ratio"])
    seqs, flat, _ = build_sequences(sample.trees, c.rl.advantage, c.env.max_turns + 2,
                                    c.rl.normalize_std)
    for k in ("generated_tokens", "rollouts_started", "prefill_tokens", "tool_calls"):
      totals[k.replace("_started", "")] = totals.get(k.replace("_started", ""), 0) + \
          sample.info.get(f"ledger_{k}", 0)
    fit_info = fit_predictor(sample.all_trees)
    engine.release(sample.all_trees)
    rec = dict(**fit_info, effective_ratio=tm["effective_ratio"], reward_mean=tm["reward_mean"],
               leaves=tm["leaves"], nodes_per_tree=tm.get("nodes_per_tree", 0),
               sample_seconds=t_sample, **{k: v for k, v in sample.info.items()
                                          if isinstance(v, (int, float))},
               generated_tokens_total=totals["generated_tokens"],
               rollouts_total=totals["rollouts"])
    if seqs:
      batch, binfo = pack_batch(seqs, c.env.max_seq_len, 3 * (c.env.max_turns + 2),
                                num_rows=_bucket(c.rl.train_rows, math.lcm(c.rl.micro_batches, dp)))
      if mesh.size > 1:
        batch = shard_batch(batch, mesh)
      if ref_params is not None:
        batch["ref_logp"] = _ref_logprobs(graphdef, ref_params, batch)
      t1 = time.time()
      state, m = update(state, batch)
      m = jax.device_get(m)
      rec.update({k: float(v) for k, v in m.items()}, update_seconds=time.time() - t1,
                 **{f"batch_{k}": v for k, v in binfo.items()})
      holder["pred"] = state["pred_params"]
      engine.update_params(state["params"])
    else:
      rec["empty_batch"] = 1.0
    rec["skipped_steps"] = int(state["skipped"])
    writer.write(step + 1, rec)
    bar.set_postfix(er=f"{tm['effective_ratio']:.2f}", r=f"{tm['reward_mean']:.2f}")
    if (step + 1) % c.eval.every == 0 or step + 1 == c.rl.steps:
      res = run_eval(step + 1)
      evals[str(step + 1)] = res["em"]
      print(f"\n[trace_jax] step {step + 1}: greedy EM {res['em']:.3f} {res['em_by_hops']}",
            flush=True)
    if (step + 1) % c.ckpt.every == 0 or step + 1 == c.rl.steps:
      ckpt.save(step + 1, state, dict(step=step + 1, totals=totals, evals=evals,
                                      predictions=predictions[-20000:], er_hist=er_hist,
                                      warm_start_probe=meta.get("warm_start_probe")))

  # ---- summary ----------------------------------------------------------------------------------
  pred_rep = {}
  calib = None
  if predictions:
    p = np.asarray([x[1] for x in predictions])
    y = np.asarray([x[2] for x in predictions])
    pred_rep = predictor_report(p, y)
    stage = np.asarray([x[0] for x in predictions])
    for st in ("root", "prefix"):  # stage 1 and stage 2 read different prefixes; report each
      if (stage == st).sum() > 1:
        pred_rep[st] = predictor_report(p[stage == st], y[stage == st])
    cc = calibration_curve(p, y)
    calib = {"bins": {k: np.asarray(v).tolist() for k, v in cc.items()}, "ece": pred_rep["ece"]}
  records = read_jsonl(writer.path)
  plots = plot_run(workdir, records, calib)
  first = sorted(evals, key=int)[0] if evals else None
  last = sorted(evals, key=int)[-1] if evals else None
  summary = dict(method=c.method, seed=c.seed, variant=c.variant, steps=c.rl.steps,
                 accuracy_start=evals.get(first, float("nan")) if first else float("nan"),
                 accuracy_final=evals.get(last, float("nan")) if last else float("nan"),
                 effective_ratio=float(np.mean(er_hist)) if er_hist else float("nan"),
                 generated_tokens=int(totals["generated_tokens"]),
                 rollouts=int(totals["rollouts"]), prefill_tokens=int(totals["prefill_tokens"]),
                 tool_calls=int(totals["tool_calls"]), skipped_steps=int(state["skipped"]),
                 wall_seconds=time.time() - t_start, workdir=workdir,
                 evals=evals, predictor=pred_rep, warm_start=ws_info,
                 warm_start_probe=meta.get("warm_start_probe"), plots=plots,
                 slot_utilization=engine.ledger.busy_slot_steps /
                 max(engine.ledger.total_slot_steps, 1))
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1, default=str)
  writer.close()
  print("\n" + format_summary(summary), flush=True)
  return summary


def step_prompts(c) -> int:
  """Prompts drawn per RL step: dapo oversamples; predicted-root methods score a candidate pool
  (`rollout.candidate_prompts`) and give rollouts to `prompts_per_step` of them."""
  r = c.rollout
  if c.method == "dapo":
    return dapo_prompts(r.prompts_per_step, r.dapo_oversample)
  if strategies.ROOT_ALLOCATION[c.method] == "predicted":
    return max(r.prompts_per_step, r.candidate_prompts)
  return r.prompts_per_step


@functools.lru_cache(maxsize=4)
def _ref_logprob_fn(graphdef):
  """Jitted reference log-probs, built once per model graph (not once per step)."""
  from trace_jax.rl.losses import token_logprobs_and_entropy

  @jax.jit
  def f(p, tokens, positions, seg):
    logits = nnx.merge(graphdef, p)(tokens, positions=positions, segment_ids=seg)
    lp, _ = token_logprobs_and_entropy(logits[:, :-1], tokens[:, 1:])
    return jnp.pad(lp, ((0, 0), (1, 0)))
  return f


def _ref_logprobs(graphdef, ref_params, batch):
  f = _ref_logprob_fn(graphdef)
  return np.asarray(f(ref_params, batch["tokens"], batch["positions"], batch["segment_ids"]))


__all__ = ["train", "make_predictor"]
