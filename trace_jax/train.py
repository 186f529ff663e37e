"""The TRACE training loop as composable steps, and `train(config) -> summary` driving them.

Sections, in the order a notebook calls them:

  run = build(c)                        # setup, data and model, warm start, sampler, update step
  state = restore(run) or init_state(run)
  state = start(run, state)             # greedy eval before RL and the warm-start probe
  for _ in range(state.step, c.rl.steps):
    sample, rec = sample_step(run, state)           # stage 1 + stage 2 rollouts of one RL step
    state, rec = update_step(run, state, sample, rec)  # predictor fit, packing, the jitted update
    state = evaluate_step(run, state) if due        # greedy held-out EM
    save(run, state) if due
  summary = finish(run, state)

`Run` holds what is built once (model graph, engine, driver, jitted functions, writers); `LoopState`
holds everything that changes from step to step, device arrays and host bookkeeping alike. Each step
function takes the state and returns the new one; nothing is read through a hidden holder.

What is not a step lives beside it: `Run`, `LoopState`, `Hooks` and the checkpoint's host state in
`trace_jax.run_state`; row packing and PPO's minibatch loop in `trace_jax.rl.ppo_loop`; the
divergence check in `trace_jax.divergence`; signals, the compilation cache and other plumbing in
`trace_jax.loop_utils`. Their names are importable from here as before.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from trace_jax import assets as assets_lib
from trace_jax import tasks
from trace_jax.checkpoint import Checkpointer, decode_host, encode_host
from trace_jax.diagnostics import prefix_signal
from trace_jax.divergence import Diverged, check_divergence
from trace_jax.evaluate import evaluate
from trace_jax.fileio import atomic_write_json
from trace_jax.lora_run import LoraRun, check_checkpoint
from trace_jax.loop_utils import (NullWriter, StopSignal, default_workdir, global_norm, host_tree,
                                  is_primary, make_predictor, retriever_stats, use_compile_cache)
from trace_jax.metrics import MetricWriter, format_summary, plot_run, read_jsonl
from trace_jax.models.predictor import PredictorHead, feature_width
from trace_jax.parallel import check_agree, fetch, initialize, local_mesh, make_mesh, shard_state
from trace_jax.parallel.distributed import (broadcast_arrays, broadcast_object, put_global_tree,
                                            run_global)
from trace_jax.provenance import environment
from trace_jax.rl.batch import tree_metrics
from trace_jax.rl.ppo_loop import (largest_tree, minibatch_order, pack_rows, ppo_updates,
                                   preds_per_row, row_len, training_units, update_rows)
from trace_jax.allocation.predictor_fit import PredictorFitter
from trace_jax.allocation.predictor_metrics import prediction_summary
from trace_jax.rl.update import (init_train_state, jit_update_step, make_optimizers, place_state,
                                 policy_params, state_shardings)
from trace_jax.allocation import strategies
from trace_jax.allocation.driver import RolloutDriver, StepSample, driver_config
from trace_jax.config import TrainConfig, sampler_config, update_config
from trace_jax.envs.adapter import TreeEnvAdapter
from trace_jax.envs.checks import CheckedEncode, check_examples
from trace_jax.envs.interface import check_env
from trace_jax.run_state import (Hooks, LoopState, Run, host_state, load_host_state,
                                 wall_seconds)
from trace_jax.sampling.multiprocess import ProcessShardedEngine, sampling_copy
from trace_jax.sampling.engine import PromptRequest, SamplerEngine
from trace_jax.sampling.tree import system_cut_leaves, without_system_cuts
from trace_jax.warm_start import warm_start


class Preempted(RuntimeError):
  """SIGTERM or SIGINT arrived: the run checkpointed its last finished step and stopped. Rerun the
  same command (same workdir) to resume."""


# ---- setup, data, model, warm start, sampler, driver, update step ------------------------------
def build(c: TrainConfig, hooks: Hooks | None = None, assets=None, task=None) -> Run:
  """Builds the run of config `c` (validated: `configs/convert.py`): workdir, mesh, the task's
  data and environment, the model and its warm start, the sampler engine and rollout driver, the
  predictor fitter and the jitted update step. `hooks` wrap parts of it (`Hooks`). The task is
  the registered `c.task` (`trace_jax.tasks`), or `task` (a `tasks.Task` of the caller's own), or
  `assets` (`assets.Assets`, with its `env` a `ToolEnv`: examples, tokenizer and environment of
  the caller's own, no warm start)."""
  t_start = time.time()
  hooks = hooks or Hooks()
  initialize()
  multi = jax.process_count() > 1
  if multi and c.rollout.off_policy_steps:
    raise ValueError("rollout.off_policy_steps=1 runs in one process (the engines of several "
                     "processes would each carry rollouts between steps); set it to 0")
  workdir = default_workdir(c)
  if multi and not c.workdir:  # the default name has a time stamp: the processes must agree
    workdir = broadcast_object(workdir)
  os.makedirs(workdir, exist_ok=True)
  if is_primary():  # one process writes the run's files (config, metrics, summary, plots)
    atomic_write_json(os.path.join(workdir, "config.json"), c.to_dict(), indent=1)
  mesh = make_mesh(c.mesh)
  process_mesh = local_mesh(mesh)  # this process's block (raises when the mesh does not split)
  writer = MetricWriter(workdir) if is_primary() else NullWriter()

  # ---- the task: data, tokenizer, environment, warm-start recipe (trace_jax.tasks)
  if task is None:
    task = tasks.get(c.task) if assets is None else tasks.Task(c.task, load=lambda _: assets)
  if assets is None:
    assets = task.load(c)
  warm = task.warm_starts(c)

  # ---- model
  model = assets_lib.build_model(c, assets.vocab_size, mesh if c.model.path else None)
  # Examples the loop cannot read, or token ids past the embedding (a NaN loss later), fail here.
  check_examples(assets.train, model.cfg.vocab_size, "train")
  check_examples(assets.test, model.cfg.vocab_size, "test")
  graphdef, params = nnx.split(model)
  head = PredictorHead(feature_width(model.cfg.hidden_size, c.model.predictor_features),
                       c.model.predictor_hidden, rngs=nnx.Rngs(c.seed + 1))
  pred_graphdef, pred_params = nnx.split(head)
  print(f"[trace_jax] workdir {workdir}; model {sum(x.size for x in jax.tree.leaves(params)):,} "
        f"params; {len(assets.train)} train / {len(assets.test)} test prompts", flush=True)

  # ---- warm start: fine-tuning on the task's expert traces (none for a pretrained checkpoint)
  warm_start_info = {}
  if warm:
    def log_sft(i, m):
      writer.write(-1, {f"sft_{k}": v for k, v in m.items()})
    params, warm_start_info = warm_start(c, assets, graphdef, params, log_sft, task=task)
    how = "restored from the cache" if warm_start_info.get("cached") else "trained"
    print(f"[trace_jax] warm start {how} ({warm_start_info.get('steps')} steps trained in "
          f"{warm_start_info.get('seconds', 0):.0f}s)", flush=True)

  # ---- environment, sampler and driver
  env = assets.env if assets.env is not None else assets_lib.build_env(c, assets)
  if hooks.retriever is not None:
    env.retriever = hooks.retriever(env.retriever)
  if hooks.env is not None:
    env = hooks.env(env)
  check_env(env)
  # Several processes: sampling is process-local, each process's engine on its own block of the
  # mesh with a copy of the weights, sampling its share of the requests and seeing every tree (see
  # `ProcessShardedEngine`); the update runs on the global mesh.
  lora = None
  if multi or (c.model.lora.rank > 0 and mesh.size > 1):
    params = shard_state(params, mesh)
  if c.model.lora.rank > 0:  # the warm-started weights become the frozen base (trace_jax.lora_run)
    lora = LoraRun.build(c, graphdef, params, mesh)
  sample_mesh = process_mesh if multi else mesh
  sample_params = lora.sampler_weights(lora.adapters) if lora else params
  if multi:
    sample_params = sampling_copy(sample_params, mesh, model.cfg.num_kv_heads)
  engine = SamplerEngine(lora.sampler_graphdef if lora else graphdef, sample_params,
                         sampler_config(c),
                         CheckedEncode(assets.encode, model.cfg.vocab_size),
                         assets.decode, TreeEnvAdapter(env), assets.eos_id,
                         mesh=sample_mesh if sample_mesh.size > 1 else None,
                         stop_strings=env.stop_strings,
                         observation_close=env.observation_close)
  engine.check_rollout_fits("a rollout of env.max_seq_len tokens")
  if multi:
    engine = ProcessShardedEngine(engine, mesh)
  predict = make_predictor(pred_graphdef)
  # The driver's predictor is set from the loop state at every sample_step.
  driver = RolloutDriver(engine, driver_config(c), None,
                         functools.partial(engine.prompt_features, keep=c.rollout.keep_pool_kv),
                         seed=c.seed)

  # ---- predictor fit and the update step
  update_cfg = update_config(c)
  if mesh.size > 1 and not multi and not lora:  # parameters born in their logical sharding;
    params = shard_state(params, mesh)  # optimizer states follow them
  if lora:  # the trained parameters are the adapters; the base stays outside the train state
    params = lora.adapters
  fitter = PredictorFitter(pred_graphdef, make_optimizers(update_cfg)[1],
                           steps=c.rl.predictor_fit_steps,
                           buffer_steps=c.rl.predictor_buffer_steps, seed=c.seed,
                           weighting=c.rl.predictor_weighting,
                           root_buffer_steps=c.rl.predictor_root_buffer_steps,
                           root_features=functools.partial(engine.prompt_features,
                                                           count_prefill=False)
                           if c.rl.predictor_refresh_roots else None,
                           leaf_weight=c.rl.predictor_leaf_weight, pred_state=pred_params,
                           holdout=c.rl.predictor_holdout, ensemble=c.rl.predictor_ensemble)
  shardings = None
  if mesh.size > 1:
    shardings = state_shardings(jax.eval_shape(
        lambda: init_train_state(params, pred_params, update_cfg)), mesh)
  ref_params = None  # the KL reference: the warm start (with LoRA, the base: adapters off)
  if c.rl.kl_coef > 0:
    ref_params = lora.base if lora else jax.tree.map(
        jnp.copy, policy_params(params, c.model.param_dtype))
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), max_to_keep=c.ckpt.max_to_keep)
  gd, kw = (lora.graphdef, lora.update_kwargs(mesh, shardings)) if lora else (graphdef, {})
  update = (jit_update_step(gd, pred_graphdef, update_cfg, shardings, None, mesh=mesh, **kw)
            if shardings is not None else jit_update_step(gd, pred_graphdef, update_cfg, **kw))
  return Run(c=c, workdir=workdir, mesh=mesh, assets=assets, graphdef=graphdef,
             pred_graphdef=pred_graphdef, env=env, engine=engine, driver=driver, fitter=fitter,
             update=update, predict=predict, writer=writer, ckpt=ckpt, ref_params=ref_params,
             shardings=shardings, init_params=params, init_pred_params=pred_params,
             update_cfg=update_cfg,
             init_param_norm=float(fetch(run_global(global_norm, params))),
             warm_start=warm_start_info, synthetic=warm, t_start=t_start, hooks=hooks,
             lora=lora)


def init_state(run: Run) -> LoopState:
  """The state before the first RL step: warm-started policy, fresh optimizers and predictor.
  On a mesh, every leaf lives on the mesh (parameters and moments in their sharding, scalars such
  as optimizer counts replicated), so a restored state has the same placement as a fresh one."""
  init = (run.init_params, run.init_pred_params)
  if run.lora is not None:  # small: copies, which the update may donate (init_state stays callable)
    init = jax.tree.map(jnp.copy, init)
  train_state = init_train_state(*init, run.update_cfg)
  if run.shardings is not None:
    train_state = place_state(train_state, run.shardings)
  else:  # committed, as the update's outputs are: else its second call compiles it again
    train_state = jax.device_put(train_state, jax.devices()[0])
  return LoopState(train=train_state)


def _policy(run: Run, state: LoopState):
  """The sampler's weights: the update's masters in the model's parameter dtype (with LoRA, the
  base and the adapters, merged or side by side: `LoraRun.sampler_weights`)."""
  if run.lora is not None:
    return run.lora.sampler_weights(state.train["params"])
  return policy_params(state.train["params"], run.c.model.param_dtype)


# ---- checkpoint / resume -----------------------------------------------------------------------
def save(run: Run, state: LoopState) -> None:
  """Checkpoints the device state and the host bookkeeping at `state.step`: everything that decides
  the future is in it (the predictor's replay buffer, the ledger), or derives from (seed, step)."""
  run.ckpt.save(state.step, state.train, dict(
      step=state.step, totals=state.totals, evals=state.evals, predictions=state.predictions,
      er_hist=state.er_hist, warm_start_probe=state.probe,
      wall_seconds=wall_seconds(run, state), host=encode_host(host_state(run)),
      **({"lora": run.lora.meta()} if run.lora else {})), force=True)


def restore(run: Run) -> LoopState | None:
  """The state of the latest checkpoint in the run's workdir, or None when there is none. Every
  leaf comes back in the placement of a fresh state (`init_state`). Metric records written after
  that checkpoint (by a run that died before the next one) are dropped, so no step is recorded
  twice; a torn last line is repaired."""
  if run.ckpt.latest_step() is None:
    run.writer.truncate(-1)  # keep only the warm start's records
    return None
  check_checkpoint(run.lora, run.ckpt.metadata(), run.ckpt.directory)  # the same base, LoRA
  target = init_state(run)
  train_state, meta = run.ckpt.restore(target.train)
  if run.shardings is not None:
    train_state = place_state(train_state, run.shardings)
  else:
    train_state = jax.device_put(train_state, jax.devices()[0])
  state = LoopState(train=train_state, step=int(meta["step"]),
                    totals=dict(meta.get("totals", target.totals)),
                    evals=dict(meta.get("evals", {})),
                    predictions=[list(p) for p in meta.get("predictions", [])],
                    er_hist=list(meta.get("er_hist", [])), probe=meta.get("warm_start_probe"),
                    wall_before=float(meta.get("wall_seconds", 0.0)))
  if "host" in meta:
    load_host_state(run, decode_host(meta["host"]))
  dropped = run.writer.truncate(state.step)
  print(f"[trace_jax] resumed at step {state.step} from {run.ckpt.directory}"
        + (f" ({dropped} metric records after it dropped)" if dropped else ""), flush=True)
  return state


# ---- evaluation and the warm-start probe --------------------------------------------------------
def evaluate_step(run: Run, state: LoopState) -> LoopState:
  """Greedy EM on the held-out prompts with the state's policy; recorded at `state.step`."""
  c, step = run.c, state.step
  run.engine.update_params(_policy(run, state))
  res = evaluate(run.engine, run.assets.test[:min(c.eval.size, len(run.assets.test))],
                 keep_trees=run.assets.wants_eval_trees, reward_is_em=run.assets.reward_is_em)
  rec = {"eval_em": res["em"], "eval_f1": res["f1"], "eval_turns": res["mean_turns"],
         "generated_tokens_total": state.totals["generated_tokens"]}
  rec.update({f"eval_{k}": v for k, v in retriever_stats(run.env).items()})
  rec.update({f"eval_em_hops{h}": v for h, v in res["em_by_hops"].items()})
  rec.update({f"eval_em_{k}": v for k, v in res["em_by_seen"].items()})  # entity seen in train
  if res["em_by_group"]:  # the lessons world: EM per lesson, and how many are above one half
    rec.update({f"eval_em_group/{k}": v for k, v in res["em_by_group"].items()})
    rec["eval_groups_learned"] = sum(v > 0.5 for v in res["em_by_group"].values())
  rec.update({f"eval_{k}": v for k, v in run.assets.eval_diagnostics(res.get("trees", [])).items()})
  run.writer.write(step, rec)
  if step == 0:
    print(f"[trace_jax] greedy EM before RL: {res['em']:.3f} by hops {res['em_by_hops']}",
          flush=True)
  else:
    print(f"\n[trace_jax] step {step}: greedy EM {res['em']:.3f} {res['em_by_hops']}", flush=True)
  return dataclasses.replace(state, evals={**state.evals, str(step): res["em"]})


def _fit_predictor(run: Run, train_state: dict, trees, steps=None) -> tuple[dict, dict]:
  """Adds the trees' prefix examples to the replay buffer and fits the head on it."""
  run.fitter.add(trees)
  if not run.c.rl.predictor_fit_steps:
    return train_state, {}
  # The fitter keeps its own optimizer state; the joint update's `pred_opt` is not touched.
  # (several processes: each fits the same host copy on the same data, process 0's result kept)
  ps, info = run.fitter.fit(host_tree(train_state["pred_params"]), steps=steps)
  ps = broadcast_arrays(ps)
  if run.shardings is not None:
    ps = put_global_tree(ps, run.shardings["pred_params"])
  return dict(train_state, pred_params=ps), info


def probe_warm_start(run: Run, state: LoopState) -> LoopState:
  """Does a misleading search really lower what follows (warm-started policy)? Samples 8 rollouts
  of `eval.probe_prompts` train prompts; their trees also give the predictor a head start."""
  c, engine = run.c, run.engine
  idx, _ = prompt_plan(c.seed, c.eval.probe_prompts, len(run.assets.train))
  probe = [run.assets.train[i] for i in idx]
  engine.update_params(_policy(run, state))
  trees = engine.run([PromptRequest(e["prompt_ids"], 8, meta=e) for e in probe])
  sig = prefix_signal(trees, run.assets.world) if hasattr(run.assets.world, "traps") else {}
  tm0 = tree_metrics(trees)
  sig["mixed_share_8"], sig["sampled_success"] = tm0["effective_ratio"], tm0["reward_mean"]
  train_state, fit_info = _fit_predictor(run, state.train, trees, steps=c.rl.predictor_warm_steps)
  sig.update(fit_info)
  engine.release(trees)
  run.writer.write(0, {f"probe_{k}": v for k, v in sig.items()})
  print(f"[trace_jax] warm-start probe: {json.dumps(sig)}", flush=True)
  return dataclasses.replace(state, train=train_state, probe=sig)


def start(run: Run, state: LoopState) -> LoopState:
  """Before the first RL step of a fresh run: greedy EM of the warm start and the probe."""
  if state.step == 0 and "0" not in state.evals:
    state = evaluate_step(run, state)
    if run.synthetic:
      state = probe_warm_start(run, state)
  return state


# ---- one RL step ---------------------------------------------------------------------------------
def step_examples(run: Run, step: int) -> list[dict]:
  """The prompts drawn at RL step `step` (a pure function of the seed and the step)."""
  _, order = prompt_plan(run.c.seed, run.c.eval.probe_prompts, len(run.assets.train))
  n = run.driver.strategy.prompts_per_step()
  return [run.assets.train[order[(step * n + j) % len(order)]] for j in range(n)]


@functools.lru_cache(maxsize=4)
def prompt_plan(seed: int, probe_prompts: int, n_train: int):
  """(probe prompt indices, prompt order), both drawn from the run's seed in this order, so a
  fresh run and every resume of it see the same prompts in the same order. A train set smaller
  than `probe_prompts` is probed whole."""
  rng = np.random.default_rng(seed)
  probe = rng.choice(n_train, min(probe_prompts, n_train), replace=False)
  return probe, rng.permutation(n_train)


def sample_step(run: Run, state: LoopState) -> tuple[StepSample, dict]:
  """Samples the trees of RL step `state.step` with the state's policy and predictor. Returns the
  driver's StepSample and the step's record so far (effective ratio, ledger, driver info)."""
  c = run.c
  t0 = time.time()
  use_pred = state.step >= c.rl.predictor_warmup_steps
  # Every random choice of the step derives from (seed, step): a resumed run draws what an
  # uninterrupted one draws, whatever ran before it in this process.
  run.engine.set_uid_base((state.step + 1) << 20)
  run.driver.rng = np.random.default_rng([c.seed, state.step, 1])
  run.fitter.rng = np.random.default_rng([c.seed, state.step, 2])
  run.engine.update_params(_policy(run, state))
  run.driver.predict = functools.partial(run.predict, host_tree(state.train["pred_params"]))
  if c.rl.predictor_ensemble > 1:
    run.driver.predict_spread = functools.partial(run.fitter.spread,
                                                  host_tree(state.train["pred_params"]))
  examples = step_examples(run, state.step)
  ahead = (step_examples(run, state.step + 1)
           if c.rollout.off_policy_steps and not drains(c, state.step) else None)
  sample = run.driver.sample(examples, use_predictor=use_pred, ahead_examples=ahead,
                             ahead_use_predictor=state.step + 1 >= c.rl.predictor_warmup_steps)
  tm = tree_metrics(sample.all_trees)
  rec = dict(effective_ratio=tm["effective_ratio"], reward_mean=tm["reward_mean"],
             leaves=tm["leaves"], nodes_per_tree=tm.get("nodes_per_tree", 0),
             sample_seconds=time.time() - t0,
             **{k: v for k, v in sample.info.items() if isinstance(v, (int, float))})
  rec.update(run.assets.step_diagnostics(examples, sample.all_trees))
  return sample, rec


def drains(c: TrainConfig, step: int) -> bool:
  """Whether RL step `step` starts no rollouts ahead (`rollout.off_policy_steps`): the last step,
  and every step after which the loop evaluates or checkpoints, so that nothing is in flight
  there (a checkpoint then holds the whole state, and evaluation has the sampler to itself)."""
  after = step + 1
  return (after >= c.rl.steps or after % c.eval.every == 0 or after % c.ckpt.every == 0)


def update_step(run: Run, state: LoopState, sample: StepSample, rec: dict | None = None
                ) -> tuple[LoopState, dict]:
  """Fits the predictor on the step's trees, packs the trained trees into rows and runs the jitted
  update. Releases the trees' KV pages. Returns the state after step `state.step` and its record."""
  c = run.c
  rec = dict(rec or {})
  use_pred = state.step >= c.rl.predictor_warmup_steps
  predictions = state.predictions + ([list(p) for p in sample.predictions] if use_pred else [])
  er_hist = state.er_hist + [tree_metrics(sample.all_trees)["effective_ratio"]]
  totals = dict(state.totals)
  for k in ("generated_tokens", "rollouts_started", "prefill_tokens", "tool_calls"):
    key = k.replace("_started", "")
    totals[key] = totals.get(key, 0) + sample.info.get(f"ledger_{k}", 0)
  # A leaf the system ended (the KV pool, a failed tool) is no outcome of the policy's: it leaves
  # values, advantages, the predictor's targets and training; its tokens stay in the ledger.
  trained = _policy_outcomes(sample.trees)
  rec.update(system_cut_leaves=system_cut_leaves(sample.all_trees),
             system_cut_trained=system_cut_leaves(trained))
  seqs = training_units(c, trained)
  # Only a method whose allocation reads p̂ pays for the extra fit (GRPO and the other uniform
  # methods train the head in the joint update alone, which costs them nothing extra).
  fit_info, train_state = {}, state.train
  if run.driver.strategy.reads_predictor:
    fit_trees = _policy_outcomes(
        sample.all_trees + (sample.slice_trees if c.rl.predictor_slice else []))
    train_state, fit_info = _fit_predictor(run, state.train, fit_trees)
  run.engine.release(sample.all_trees)
  rec.update(fit_info, generated_tokens_total=totals["generated_tokens"],
             rollouts_total=totals["rollouts"])
  if seqs:
    batch, binfo = pack_rows(c, run.mesh, seqs)
    if run.hooks.batch is not None:
      batch = run.hooks.batch(state.step, batch)
    t1 = time.time()
    train_state, m = ppo_updates(c, run.mesh, run.update, train_state, batch, state.step,
                                 graphdef=run.graphdef, ref_params=run.ref_params,
                                 base=run.lora.base if run.lora else None)
    rec.update(m, update_seconds=time.time() - t1,
               **{f"batch_{k}": v for k, v in binfo.items()})
  else:
    rec["empty_batch"] = 1.0
  rec["skipped_steps"] = int(fetch(train_state["skipped"]))
  rec.update(retriever_stats(run.env))
  # Every process must have built the same step (a silent divergence would train on mixed data).
  check_agree(f"RL step {state.step}", {k: rec.get(k) for k in (
      "effective_ratio", "reward_mean", "leaves", "loss", "rollouts_total",
      "generated_tokens_total", "predictor_fit_bce_last")})
  state = dataclasses.replace(state, train=train_state, step=state.step + 1, totals=totals,
                              predictions=predictions[-20000:], er_hist=er_hist)
  run.writer.write(state.step, rec)
  return state, rec


def _policy_outcomes(trees) -> list:
  """`trees` without the leaves the system ended (`sampling.tree.without_system_cuts`)."""
  out = (without_system_cuts(t) for t in trees)
  return [t for t in out if t is not None]


# ---- summary -------------------------------------------------------------------------------------
def finish(run: Run, state: LoopState) -> dict:
  """Writes summary.json and the plots of the run; returns the summary."""
  c = run.c
  pred_rep, calib = prediction_summary(state.predictions)
  plots = plot_run(run.workdir, read_jsonl(run.writer.path), calib) if is_primary() else []
  evals = state.evals
  first = sorted(evals, key=int)[0] if evals else None
  last = sorted(evals, key=int)[-1] if evals else None
  led = run.engine.ledger
  summary = dict(method=c.method, seed=c.seed, variant=c.variant, steps=c.rl.steps,
                 accuracy_start=evals[first] if first else float("nan"),
                 accuracy_final=evals[last] if last else float("nan"),
                 effective_ratio=float(np.mean(state.er_hist)) if state.er_hist else float("nan"),
                 generated_tokens=int(state.totals["generated_tokens"]),
                 rollouts=int(state.totals["rollouts"]),
                 prefill_tokens=int(state.totals["prefill_tokens"]),
                 tool_calls=int(state.totals["tool_calls"]),
                 skipped_steps=int(fetch(state.train["skipped"])),
                 wall_seconds=wall_seconds(run, state),
                 workdir=run.workdir,
                 evals=evals, predictor=pred_rep, warm_start=run.warm_start,
                 warm_start_probe=state.probe, plots=plots,
                 slot_utilization=led.busy_slot_steps / max(led.total_slot_steps, 1),
                 environment=environment())
  if is_primary():
    atomic_write_json(os.path.join(run.workdir, "summary.json"), summary, indent=1, default=str)
    print("\n" + format_summary(summary), flush=True)
  return summary


# ---- the loop ----------------------------------------------------------------------------------
def train(c: TrainConfig, hooks: Hooks | None = None, assets=None, task=None) -> dict:
  """Runs the warm start (when the task has one) and RL with the configured method; returns the
  summary. The task is `c.task` in the registry (`trace_jax.tasks`), or `task` (a `Task` of the
  caller's own), or `assets` (examples, tokenizer and environment; no warm start).

  SIGTERM/SIGINT finish the current step, checkpoint it and raise `Preempted`; signs of divergence
  raise `Diverged` without checkpointing the bad state (see `check_divergence`)."""
  with StopSignal() as stop:
    run = build(c, hooks, assets, task)
    state = restore(run) or init_state(run)
    stop.agree()  # (several processes: every read of the flag follows an agreement)
    if stop.requested:
      raise Preempted(f"{stop.requested} during setup; nothing to checkpoint")
    state = start(run, state)
    bar = tqdm(range(state.step, c.rl.steps), desc=f"RL ({c.method})", initial=state.step,
               total=c.rl.steps, disable=not is_primary())
    for _ in bar:
      stop.agree()
      if stop.requested:
        break
      sample, rec = sample_step(run, state)
      state, rec = update_step(run, state, sample, rec)
      bar.set_postfix(er=f"{rec['effective_ratio']:.2f}", r=f"{rec['reward_mean']:.2f}")
      if state.step % c.eval.every == 0 or state.step == c.rl.steps:
        state = evaluate_step(run, state)
        rec = dict(rec, eval_em=state.evals[str(state.step)])
      check_divergence(run, state, rec)
      stop.agree()
      if stop.requested and run.engine.carried:
        break  # rollouts in flight for the next step: the last checkpoint is the exact one
      if state.step % c.ckpt.every == 0 or state.step == c.rl.steps or stop.requested:
        save(run, state)
    stop.agree()
    if stop.requested:
      if run.engine.carried:  # a checkpoint here would not hold them, so resume would differ
        run.driver.drop_ahead()
      elif run.ckpt.latest_step() != state.step:
        save(run, state)
      run.writer.close()
      last = run.ckpt.latest_step()
      raise Preempted(f"{stop.requested}: " + (
          f"checkpointed step {last} under {run.ckpt.directory}" if last is not None else
          "no checkpoint yet") + "; rerun the same command to resume")
    summary = finish(run, state)
    run.writer.close()
    return summary


def step_prompts(c: TrainConfig) -> int:
  """Prompts drawn per RL step: what the method's strategy asks for (a candidate pool for the
  predicted roots, an oversampled set for dapo, else `rollout.prompts_per_step`)."""
  return strategies.get(c.method)(driver_config(c)).prompts_per_step()


__all__ = ["Diverged", "Hooks", "LoopState", "NullWriter", "Preempted", "Run", "StopSignal",
           "build", "check_divergence", "drains", "evaluate_step", "finish", "host_state",
           "host_tree", "init_state", "largest_tree", "load_host_state", "make_predictor",
           "minibatch_order", "pack_rows", "policy_params", "preds_per_row", "probe_warm_start",
           "prompt_plan", "restore", "row_len", "sample_step", "save", "start", "step_examples",
           "step_prompts", "train", "training_units", "update_rows", "update_step",
           "use_compile_cache", "wall_seconds"]
