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
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import signal
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from trace_jax import assets as assets_lib
from trace_jax.checkpoint import Checkpointer, decode_host, encode_host
from trace_jax.diagnostics import prefix_signal
from trace_jax.evaluate import evaluate
from trace_jax.metrics import MetricWriter, format_summary, plot_run, read_jsonl
from trace_jax.models.predictor import PredictorHead, feature_width
from trace_jax.parallel import (allgather_object, check_agree, fetch, initialize, local_mesh,
                                make_mesh, shard_batch, shard_state)
from trace_jax.parallel.distributed import (broadcast_arrays, broadcast_object, put_global_tree,
                                            run_global)
from trace_jax.parallel.micro_batch import padded_rows, row_shards
from trace_jax.provenance import environment
from trace_jax.rl.batch import (build_sequences, build_tree_units, pack_batch, row_buckets,
                                tree_metrics)
from trace_jax.allocation.predictor_fit import PredictorFitter
from trace_jax.allocation.predictor_metrics import calibration_curve, predictor_report
from trace_jax.rl.update import (UpdateConfig, init_train_state, jit_update_step,
                                 make_optimizers, place_state, policy_params, reference_logprobs,
                                 state_shardings)
from trace_jax.allocation import strategies
from trace_jax.allocation.driver import RolloutDriver, StepSample
from trace_jax.config import TrainConfig, driver_config, sampler_config, update_config
from trace_jax.envs.adapter import TreeEnvAdapter
from trace_jax.envs.interface import check_env
from trace_jax.sampling.multiprocess import ProcessShardedEngine, sampling_copy
from trace_jax.sampling.engine import PromptRequest, SamplerEngine

log = logging.getLogger(__name__)


class Preempted(RuntimeError):
  """SIGTERM or SIGINT arrived: the run checkpointed its last finished step and stopped. Rerun the
  same command (same workdir) to resume."""


class Diverged(RuntimeError):
  """The run stopped on a sign of divergence (consecutive skipped updates, exploding parameters,
  held-out accuracy collapsed to zero); nothing was checkpointed after the first bad step."""


def _primary() -> bool:
  """Whether this process writes the run's files (the only process, or process 0 of several)."""
  return jax.process_index() == 0


class NullWriter:
  """`MetricWriter`'s interface for processes other than process 0: records go nowhere."""
  path = None

  def write(self, step: int, record: dict) -> None:
    pass

  def truncate(self, last_step: int) -> int:
    return 0

  def close(self) -> None:
    pass


def _host(tree):
  """A pytree of (possibly global) arrays as host values; one process: unchanged."""
  return tree if jax.process_count() == 1 else jax.tree.map(fetch, tree)


def _retriever_stats(env) -> dict:
  """The environment's retriever counters since the last call, summed over the processes (the
  mean latency weighted by calls, the max over processes)."""
  if not hasattr(env, "retriever_stats"):  # a task without a retriever
    return {}
  st = env.retriever_stats(reset=True)
  if jax.process_count() == 1:
    return st
  parts = allgather_object(st)
  out = {k: sum(p.get(k, 0) for p in parts) for k in st}
  calls = out.get("retriever_calls", 0)
  if "retriever_latency_mean_s" in st:
    out["retriever_latency_mean_s"] = (sum(p["retriever_latency_mean_s"] * p["retriever_calls"]
                                           for p in parts) / calls if calls else 0.0)
  if "retriever_latency_max_s" in st:
    out["retriever_latency_max_s"] = max(p["retriever_latency_max_s"] for p in parts)
  return out


def make_predictor(pred_graphdef):
  """Jitted p̂ from features [N, D], padded to buckets of 64 rows (one compile per bucket)."""
  @jax.jit
  def _probs(pred_state, feats):
    return nnx.merge(pred_graphdef, pred_state).prob(feats)

  def predict(pred_state, feats):
    feats = np.asarray(feats, np.float32)
    n = feats.shape[0]
    pad = np.zeros((padded_rows(n, 1, 64), feats.shape[1]), np.float32)  # 64-row buckets
    pad[:n] = feats
    return np.asarray(_probs(pred_state, pad))[:n]

  return predict


def _workdir(c: TrainConfig) -> str:
  if c.workdir:
    return c.workdir
  stamp = time.strftime("%Y%m%d-%H%M%S")
  return os.path.join("runs", f"{c.variant}-{c.method}-seed{c.seed}-{stamp}")


@dataclasses.dataclass(frozen=True)
class Hooks:
  """Where a caller may wrap a run's parts (fault injection in tests and the chaos benchmark,
  instrumentation): each is a function from the part the run built to the one it uses, or None.

  retriever: the retriever -> the one the environment searches with.
  env: the environment -> the one the sampler steps.
  batch: (RL step, packed batch dict) -> the batch the update trains on.
  """
  retriever: Callable[[Any], Any] | None = None
  env: Callable[[Any], Any] | None = None
  batch: Callable[[int, dict], dict] | None = None


@dataclasses.dataclass
class Run:
  """What a run builds once. The engine, driver and fitter keep host-side state of their own
  (rng streams, the predictor's replay buffer); `host_state`/`load_host_state` read and set it so
  a checkpoint holds everything that decides the future."""
  c: TrainConfig
  workdir: str
  mesh: Any
  assets: Any
  graphdef: Any
  pred_graphdef: Any
  env: Any                    # the multi-hop environment (its retriever's stats go to the metrics)
  engine: SamplerEngine
  driver: RolloutDriver
  fitter: PredictorFitter
  update: Callable            # jitted (train_state, batch) -> (train_state, metrics)
  predict: Callable           # (pred_params, features f32[N, D]) -> p̂ f32[N]
  writer: MetricWriter
  ckpt: Checkpointer
  ref_params: Any             # frozen reference policy (only when rl.kl_coef > 0)
  shardings: Any              # NamedShardings of the train state on a multi-device mesh, else None
  init_params: Any            # policy after the warm start (RL starts here)
  init_pred_params: Any
  update_cfg: UpdateConfig
  init_param_norm: float      # global norm of the warm-started policy (divergence reference)
  warm_start: dict
  synthetic: bool
  t_start: float
  hooks: Hooks = Hooks()


@dataclasses.dataclass
class LoopState:
  """Everything that changes during RL. `train` is the device pytree the jitted update takes
  (params, opt, pred_params, pred_opt, step, skipped); the rest is host bookkeeping."""
  train: dict
  step: int = 0                      # RL steps done
  totals: dict = dataclasses.field(default_factory=lambda: dict(
      generated_tokens=0, rollouts=0, prefill_tokens=0, tool_calls=0))
  evals: dict = dataclasses.field(default_factory=dict)   # str(step) -> greedy EM
  predictions: list = dataclasses.field(default_factory=list)  # (stage, p̂, outcome)
  er_hist: list = dataclasses.field(default_factory=list)
  probe: dict | None = None          # the warm-start probe (first run only)
  wall_before: float = 0.0           # wall seconds of the earlier processes, to their checkpoint

  @property
  def skip_streak(self) -> int:
    """Consecutive updates skipped as non-finite (the update's own count,
    `train["skip_streak"]`)."""
    return int(fetch(self.train["skip_streak"]))


# ---- setup, data, model, warm start, sampler, driver, update step ------------------------------
def build(c: TrainConfig, hooks: Hooks | None = None, assets=None) -> Run:
  """Builds the run of config `c` (validated: `configs/convert.py`): workdir, mesh, data and
  model, the warm start (synthetic world), the sampler engine and rollout driver, the predictor
  fitter and the jitted update step. `hooks` wrap parts of it (`Hooks`). `assets`
  (`assets.Assets`, with its `env` a `ToolEnv`) plugs in a task of the caller's own: its
  tokenizer, examples and environment replace the config's data, and there is no warm start."""
  t_start = time.time()
  hooks = hooks or Hooks()
  initialize()
  multi = jax.process_count() > 1
  if multi and c.rollout.off_policy_steps:
    raise ValueError("rollout.off_policy_steps=1 runs in one process (the engines of several "
                     "processes would each carry rollouts between steps); set it to 0")
  workdir = _workdir(c)
  if multi and not c.workdir:  # the default name has a time stamp: the processes must agree
    workdir = broadcast_object(workdir)
  os.makedirs(workdir, exist_ok=True)
  if _primary():  # one process writes the run's files (config, metrics, summary, plots)
    with open(os.path.join(workdir, "config.json"), "w") as f:
      json.dump(c.to_dict(), f, indent=1)
  mesh = make_mesh(c.mesh)
  process_mesh = local_mesh(mesh)  # this process's block (raises when the mesh does not split)
  writer = MetricWriter(workdir) if _primary() else NullWriter()

  # ---- data and model
  synthetic = assets is None and not assets_lib.uses_real_data(c)  # embedded data: warm start
  if assets is None:
    assets = assets_lib.load_assets(c)
  model = assets_lib.build_model(c, assets.vocab_size, mesh if c.model.path else None)
  graphdef, params = nnx.split(model)
  head = PredictorHead(feature_width(model.cfg.hidden_size, c.model.predictor_features),
                       c.model.predictor_hidden, rngs=nnx.Rngs(c.seed + 1))
  pred_graphdef, pred_params = nnx.split(head)
  print(f"[trace_jax] workdir {workdir}; model {sum(x.size for x in jax.tree.leaves(params)):,} "
        f"params; {len(assets.train)} train / {len(assets.test)} test prompts", flush=True)

  # ---- warm start (synthetic world)
  warm_start_info = {}
  if synthetic:
    def log_sft(i, m):
      writer.write(-1, {f"sft_{k}": v for k, v in m.items()})
    params, warm_start_info = assets_lib.warm_start(c, assets, graphdef, params, log_sft)
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
  if multi:
    params = shard_state(params, mesh)
  sample_mesh = process_mesh if multi else mesh
  sample_params = sampling_copy(params, mesh, model.cfg.num_kv_heads) if multi else params
  engine = SamplerEngine(graphdef, sample_params, sampler_config(c), assets.encode,
                         assets.decode, TreeEnvAdapter(env), assets.eos_id,
                         mesh=sample_mesh if sample_mesh.size > 1 else None,
                         stop_strings=env.stop_strings,
                         observation_close=env.observation_close)
  engine.check_tree_fits(largest_tree(c), "the largest tree a step or the probe samples")
  if multi:
    engine = ProcessShardedEngine(engine, mesh)
  predict = make_predictor(pred_graphdef)
  # The driver's predictor is set from the loop state at every sample_step.
  driver = RolloutDriver(engine, driver_config(c), None,
                         functools.partial(engine.prompt_features, keep=c.rollout.keep_pool_kv),
                         seed=c.seed)

  # ---- predictor fit and the update step
  update_cfg = update_config(c)
  if mesh.size > 1 and not multi:  # parameters born in their logical sharding; optimizer states
    params = shard_state(params, mesh)  # follow them
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
  ref_params = (jax.tree.map(jnp.copy, policy_params(params, c.model.param_dtype))
                if c.rl.kl_coef > 0 else None)
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), max_to_keep=c.ckpt.max_to_keep)
  update = (jit_update_step(graphdef, pred_graphdef, update_cfg, shardings, None, mesh=mesh)
            if shardings is not None else jit_update_step(graphdef, pred_graphdef, update_cfg))
  return Run(c=c, workdir=workdir, mesh=mesh, assets=assets, graphdef=graphdef,
             pred_graphdef=pred_graphdef, env=env, engine=engine, driver=driver, fitter=fitter,
             update=update, predict=predict, writer=writer, ckpt=ckpt, ref_params=ref_params,
             shardings=shardings, init_params=params, init_pred_params=pred_params,
             update_cfg=update_cfg,
             init_param_norm=float(fetch(run_global(_global_norm, params))),
             warm_start=warm_start_info, synthetic=synthetic, t_start=t_start, hooks=hooks)


def init_state(run: Run) -> LoopState:
  """The state before the first RL step: warm-started policy, fresh optimizers and predictor.
  On a mesh, every leaf lives on the mesh (parameters and moments in their sharding, scalars such
  as optimizer counts replicated), so a restored state has the same placement as a fresh one."""
  train_state = init_train_state(run.init_params, run.init_pred_params, run.update_cfg)
  if run.shardings is not None:
    train_state = place_state(train_state, run.shardings)
  else:  # committed, as the update's outputs are: else its second call compiles it again
    train_state = jax.device_put(train_state, jax.devices()[0])
  return LoopState(train=train_state)


def _policy(run: Run, state: LoopState):
  """The sampler's weights: the update's masters in the model's parameter dtype."""
  return policy_params(state.train["params"], run.c.model.param_dtype)


@jax.jit
def _global_norm(params):
  return optax.tree.norm(params)


# ---- checkpoint / resume -----------------------------------------------------------------------
def save(run: Run, state: LoopState) -> None:
  """Checkpoints the device state and the host bookkeeping at `state.step`: everything that decides
  the future is in it (the predictor's replay buffer, the ledger), or derives from (seed, step)."""
  run.ckpt.save(state.step, state.train, dict(
      step=state.step, totals=state.totals, evals=state.evals, predictions=state.predictions,
      er_hist=state.er_hist, warm_start_probe=state.probe,
      wall_seconds=wall_seconds(run, state),
      host=encode_host(host_state(run))), force=True)


def wall_seconds(run: Run, state: LoopState) -> float:
  """The run's wall clock over every process it took, up to now (a stopped process's work after
  its last checkpoint is redone, so it is not counted)."""
  return state.wall_before + time.time() - run.t_start


def host_state(run: Run) -> dict:
  """What the run's host objects carry from one step to the next: the predictor fitter's replay
  buffers and optimizer state, the engine's ledger and the driver's record of p̂ on random pool
  slices (its running metrics). (Rng streams are reseeded from (seed,
  step) at every step.)"""
  return {"fitter_buffer": list(run.fitter.buffer), "fitter_roots": list(run.fitter.roots),
          "fitter_opt": [np.asarray(x) for x in jax.tree.leaves(run.fitter.state_dict())],
          "ledger": run.engine.ledger.as_dict(),
          **run.driver.state_dict()}


def load_host_state(run: Run, d: dict) -> None:
  run.fitter.buffer.clear()
  run.fitter.buffer.extend(tuple(e) for e in d["fitter_buffer"])
  run.fitter.roots.clear()
  run.fitter.roots.extend(tuple(e) for e in d["fitter_roots"])
  tree = jax.tree.structure(run.fitter.state_dict())
  run.fitter.load_state_dict(jax.tree.unflatten(tree, [jnp.asarray(x) for x in d["fitter_opt"]]))
  run.driver.load_state_dict(d)
  for k, v in d["ledger"].items():
    setattr(run.engine.ledger, k, v)


def restore(run: Run) -> LoopState | None:
  """The state of the latest checkpoint in the run's workdir, or None when there is none. Every
  leaf comes back in the placement of a fresh state (`init_state`). Metric records written after
  that checkpoint (by a run that died before the next one) are dropped, so no step is recorded
  twice; a torn last line is repaired."""
  if run.ckpt.latest_step() is None:
    run.writer.truncate(-1)  # keep only the warm start's records
    return None
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
  rec.update({f"eval_{k}": v for k, v in _retriever_stats(run.env).items()})
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
  ps, info = run.fitter.fit(_host(train_state["pred_params"]), steps=steps)
  ps = broadcast_arrays(ps)
  if run.shardings is not None:
    ps = put_global_tree(ps, run.shardings["pred_params"])
  return dict(train_state, pred_params=ps), info


def probe_warm_start(run: Run, state: LoopState) -> LoopState:
  """Does a misleading search really lower what follows (warm-started policy)? Samples 8 rollouts
  of `eval.probe_prompts` train prompts; their trees also give the predictor a head start."""
  c, engine = run.c, run.engine
  idx, _ = _prompt_plan(c.seed, c.eval.probe_prompts, len(run.assets.train))
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
  _, order = _prompt_plan(run.c.seed, run.c.eval.probe_prompts, len(run.assets.train))
  n = run.driver.strategy.prompts_per_step()
  return [run.assets.train[order[(step * n + j) % len(order)]] for j in range(n)]


@functools.lru_cache(maxsize=4)
def _prompt_plan(seed: int, probe_prompts: int, n_train: int):
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
  run.driver.predict = functools.partial(run.predict, _host(state.train["pred_params"]))
  if c.rl.predictor_ensemble > 1:
    run.driver.predict_spread = functools.partial(run.fitter.spread,
                                                  _host(state.train["pred_params"]))
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
  seqs = training_units(c, sample.trees)
  # Only a method whose allocation reads p̂ pays for the extra fit (GRPO and the other uniform
  # methods train the head in the joint update alone, which costs them nothing extra).
  fit_info, train_state = {}, state.train
  if run.driver.strategy.reads_predictor:
    fit_trees = sample.all_trees + (sample.slice_trees if c.rl.predictor_slice else [])
    train_state, fit_info = _fit_predictor(run, state.train, fit_trees)
  run.engine.release(sample.all_trees)
  rec.update(fit_info, generated_tokens_total=totals["generated_tokens"],
             rollouts_total=totals["rollouts"])
  if seqs:
    batch, binfo = pack_rows(c, run.mesh, seqs)
    if run.hooks.batch is not None:
      batch = run.hooks.batch(state.step, batch)
    t1 = time.time()
    train_state, m = _ppo_updates(run, train_state, batch, state.step)
    rec.update(m, update_seconds=time.time() - t1,
               **{f"batch_{k}": v for k, v in binfo.items()})
  else:
    rec["empty_batch"] = 1.0
  rec["skipped_steps"] = int(fetch(train_state["skipped"]))
  rec.update(_retriever_stats(run.env))
  # Every process must have built the same step (a silent divergence would train on mixed data).
  check_agree(f"RL step {state.step}", {k: rec.get(k) for k in (
      "effective_ratio", "reward_mean", "leaves", "loss", "rollouts_total",
      "generated_tokens_total", "predictor_fit_bce_last")})
  state = dataclasses.replace(state, train=train_state, step=state.step + 1, totals=totals,
                              predictions=predictions[-20000:], er_hist=er_hist)
  run.writer.write(state.step, rec)
  return state, rec


def row_len(c: TrainConfig) -> int:
  """Tokens per update row: `env.max_seq_len`, or with tree packing `rl.pack_row_len` when set
  (longer rows keep bigger trees whole; a row's attention costs its length squared)."""
  if c.rl.packing == "tree" and c.rl.pack_row_len > 0:
    return c.rl.pack_row_len
  return c.env.max_seq_len


def preds_per_row(c: TrainConfig) -> int:
  """Predictor entries per packed row: three root-to-leaf paths' nodes unpacked; with tree
  packing (one entry per weighted node, a row holding a whole tree's nodes) eight paths' worth
  per `env.max_seq_len` tokens of row, and a unit is split before it holds more."""
  if c.rl.packing == "tree":
    return 8 * (c.env.max_turns + 2) * -(-row_len(c) // c.env.max_seq_len)
  return 3 * (c.env.max_turns + 2)


def training_units(c: TrainConfig, trees) -> list[dict]:
  """The step's trained trees as the units `pack_batch` lays out: one sequence per leaf
  (`rl.packing=none`) or each tree's nodes once per unit (`tree`), with the method's advantage
  estimator and the run's value estimator."""
  kw = dict(kind=strategies.advantage_for(c.method, c.rl.advantage),
            max_depth=c.env.max_turns + 2, normalize=c.rl.normalize_std,
            pred_leaf_weight=c.rl.predictor_leaf_weight, values=c.rl.tree_values)
  if c.rl.packing == "tree":
    return build_tree_units(trees, row_len=row_len(c), max_nodes=preds_per_row(c),
                            cut_len=c.env.max_seq_len, **kw)[0]
  return build_sequences(trees, **kw)[0]


def pack_rows(c: TrainConfig, mesh, units: list[dict]):
  """(batch, info) of `pack_batch`: a fixed `update_rows` rows unpacked; tree-packed, the
  smallest of `row_buckets` that holds the units (shapes follow the work), up to the token slots
  of `update_rows` rows of `env.max_seq_len`."""
  rows = update_rows(c, mesh)
  if c.rl.packing == "tree":
    multiple = c.rl.micro_batches * c.rl.minibatches * row_shards(mesh if mesh.size > 1 else None)
    cap = -(-rows * c.env.max_seq_len // row_len(c))
    return pack_batch(units, row_len(c), preds_per_row(c), buckets=row_buckets(cap, multiple))
  return pack_batch(units, c.env.max_seq_len, preds_per_row(c), num_rows=rows)


def minibatch_order(rows: int, minibatches: int, epochs: int, seed: int, step: int):
  """The row indices of every optimizer step of one RL step: `epochs` passes over the packed
  rows, each split into `minibatches` equal groups; rows are shuffled per pass (from (seed, step),
  so a resumed step repeats its order) when there is more than one group. A list of i64 arrays."""
  size = rows // minibatches
  rng = np.random.default_rng([seed, step, 7])
  out = []
  for _ in range(epochs):
    order = rng.permutation(rows) if minibatches > 1 else np.arange(rows)
    out += [np.sort(order[i * size:(i + 1) * size]) for i in range(minibatches)]
  return out


def _ppo_updates(run: Run, train_state, batch: dict, step: int):
  """`rl.ppo_epochs` x `rl.minibatches` optimizer steps on the packed batch (PPO's reuse of one
  step's rollouts; 1 x 1 is one step on everything). Every update sees the sampler's log-probs as
  the old policy, so from the second update on the ratio moves and the clip acts. Returns the new
  state and the step's record: each update metric's mean over the updates, the first and last
  update's clip fraction and approximate KL, and `optimizer_steps`."""
  c = run.c
  rows = len(batch["tokens"])
  sharded = run.mesh.size > 1
  groups = minibatch_order(rows, c.rl.minibatches, c.rl.ppo_epochs, c.seed, step)
  records = []
  for idx in groups:
    mb = {k: v[idx] for k, v in batch.items()} if len(groups) > 1 else batch
    if sharded:
      mb = shard_batch(mb, run.mesh)
    if run.ref_params is not None:
      mb["ref_logp"] = reference_logprobs(
          run.graphdef, run.ref_params, mb, c.rl.micro_batches,
          run.mesh if sharded else None, temperature=c.rollout.temperature)
    train_state, m = run_global(run.update, train_state, mb)
    records.append({k: float(v) for k, v in jax.device_get(_host(m)).items()})
  out = {k: float(np.mean([r[k] for r in records])) for k in records[0]}
  for k in ("skipped", "finite"):  # a step counts as skipped if any of its updates was
    out[k] = (max if k == "skipped" else min)(r[k] for r in records)
  out["skip_streak"] = records[-1]["skip_streak"]
  out["param_norm"] = records[-1]["param_norm"]
  for k in ("clip_frac", "approx_kl"):
    out[f"{k}_first"], out[f"{k}_last"] = records[0][k], records[-1][k]
  out["optimizer_steps"] = float(len(records))
  return train_state, out


def largest_tree(c: TrainConfig) -> int:
  """The most rollouts one tree of a run starts from its root: a GRPO-style group (the whole
  per-step budget spread over the prompts), stage 1's per-prompt cap (bounded by what the budget
  leaves after every other prompt's minimum), the warm-start probe's 8 samples, or a metric-slice
  tree. Stage-2 continuations are not counted (see `SamplerEngine.check_tree_fits`)."""
  r = c.rollout
  n = max(int(r.prompts_per_step), 1)
  group = -(-(r.root_budget + r.prefix_budget) // n)
  cap = max(r.max_per_prompt, -(-r.root_budget // n))
  stage1 = min(cap, r.root_budget - (n - 1) * r.min_per_prompt)
  probe = 8 if c.eval.probe_prompts > 0 else 0
  slice_ = r.metric_rollouts if r.metric_slice > 0 else 0
  return int(max(group, stage1, probe, slice_))


def update_rows(c: TrainConfig, mesh) -> int:
  """Packed rows per update: `rl.train_rows` rounded up to a multiple of `rl.micro_batches` x the
  row shards of the mesh (data x fsdp) x `rl.minibatches`, so every minibatch's micro-batches
  split evenly over the shards."""
  return padded_rows(c.rl.train_rows, c.rl.micro_batches * c.rl.minibatches,
                     row_shards(mesh if mesh.size > 1 else None))


def check_divergence(run: Run, state: LoopState, rec: dict) -> None:
  """Raises `Diverged` when the step's record shows the run going bad: `rl.max_consecutive_skips`
  RL steps' worth of updates in a row skipped as non-finite (times `rl.ppo_epochs` x
  `rl.minibatches` optimizer updates, so one bad batch, every update of its step skipped, counts
  as one), parameters grown past `rl.max_param_growth` times their warm-start norm (or not
  finite), or, with `eval.stop_on_collapse`, held-out EM fallen to zero from a positive start."""
  c = run.c
  latest = run.ckpt.latest_step()
  keep = (f"the last checkpoint (step {latest}) is kept" if latest is not None
          else "no checkpoint was written")
  why = None
  per_step = c.rl.ppo_epochs * c.rl.minibatches
  if state.skip_streak >= c.rl.max_consecutive_skips * per_step:
    why = (f"{state.skip_streak} consecutive updates ({per_step} per RL step) had non-finite loss, "
           f"gradients or parameters and were skipped")
  norm = rec.get("param_norm")
  if norm is not None and not norm <= c.rl.max_param_growth * max(run.init_param_norm, 1e-6):
    why = (f"the parameter norm reached {norm:.4g}, over rl.max_param_growth="
           f"{c.rl.max_param_growth:g} x its warm-start norm {run.init_param_norm:.3g}")
  em0, em = state.evals.get("0"), state.evals.get(str(state.step))
  if c.eval.stop_on_collapse and "eval_em" in rec and em0 and em0 > 0 and em == 0:
    why = f"held-out greedy EM collapsed from {em0:.3f} to 0 (eval.stop_on_collapse)"
  if why:
    raise Diverged(f"training diverged at RL step {state.step}: {why}; {keep} under "
                   f"{run.ckpt.directory}. Lower rl.lr, or raise the limit if this is expected.")


# ---- summary -------------------------------------------------------------------------------------
def finish(run: Run, state: LoopState) -> dict:
  """Writes summary.json and the plots of the run; returns the summary."""
  c = run.c
  pred_rep, calib = {}, None
  if state.predictions:
    p = np.asarray([x[1] for x in state.predictions])
    y = np.asarray([x[2] for x in state.predictions])
    pred_rep = predictor_report(p, y)
    stage = np.asarray([x[0] for x in state.predictions])
    for st in ("root", "prefix"):  # stage 1 and stage 2 read different prefixes; report each
      if (stage == st).sum() > 1:
        pred_rep[st] = predictor_report(p[stage == st], y[stage == st])
    cc = calibration_curve(p, y)
    calib = {"bins": {k: np.asarray(v).tolist() for k, v in cc.items()}, "ece": pred_rep["ece"]}
  plots = plot_run(run.workdir, read_jsonl(run.writer.path), calib) if _primary() else []
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
  if _primary():
    with open(os.path.join(run.workdir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=1, default=str)
    print("\n" + format_summary(summary), flush=True)
  return summary


# ---- the loop ----------------------------------------------------------------------------------
class StopSignal:
  """Turns SIGTERM/SIGINT into a flag the loop reads between steps (installed by `train` in the
  main thread only); `requested` names the signal once one arrived."""

  def __init__(self):
    self.requested, self._old = None, {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._old[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame):
    if self.requested is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt  # a second Ctrl-C stops at once
    self.requested = signal.Signals(signum).name
    print(f"\n[trace_jax] {self.requested}: finishing this step, then checkpointing", flush=True)

  def agree(self) -> None:
    """Several processes: a signal to any of them stops all of them at the same step (they
    checkpoint together). A collective; one process: nothing to do."""
    if jax.process_count() > 1:
      self.requested = next((r for r in allgather_object(self.requested) if r), None)

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)


def train(c: TrainConfig, hooks: Hooks | None = None, assets=None) -> dict:
  """Runs warm start (synthetic world) and RL with the configured method; returns the summary.
  `assets`: a task of the caller's own (`build`).

  SIGTERM/SIGINT finish the current step, checkpoint it and raise `Preempted`; signs of divergence
  raise `Diverged` without checkpointing the bad state (see `check_divergence`)."""
  with StopSignal() as stop:
    run = build(c, hooks, assets)
    state = restore(run) or init_state(run)
    stop.agree()  # (several processes: every read of the flag follows an agreement)
    if stop.requested:
      raise Preempted(f"{stop.requested} during setup; nothing to checkpoint")
    state = start(run, state)
    bar = tqdm(range(state.step, c.rl.steps), desc=f"RL ({c.method})", initial=state.step,
               total=c.rl.steps, disable=not _primary())
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


def use_compile_cache(path: str, min_compile_s: float = 0.5) -> str | None:
  """Turns on XLA's persistent compilation cache under `path`; call it before anything compiles.
  A compiled function is stored on disk and the next process that needs the same computation
  loads it instead of compiling, so only a machine's first run of a shape pays for it (a
  campaign's runs share every shape). What a run computes does not change (the same program is
  loaded), so resume stays exact. Returns the directory used, or None when `path` is empty or
  JAX_COMPILATION_CACHE_DIR is set (the environment wins)."""
  if not path or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return None
  path = os.path.abspath(path)
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_s)
  return path


def step_prompts(c: TrainConfig) -> int:
  """Prompts drawn per RL step: what the method's strategy asks for (a candidate pool for the
  predicted roots, an oversampled set for dapo, else `rollout.prompts_per_step`)."""
  return strategies.get(c.method)(driver_config(c)).prompts_per_step()


__all__ = ["Diverged", "Hooks", "LoopState", "Preempted", "Run", "build", "check_divergence",
           "evaluate_step", "finish", "init_state", "make_predictor", "probe_warm_start",
           "restore", "sample_step", "save", "start", "step_examples", "step_prompts", "train",
           "update_rows", "update_step", "use_compile_cache"]
