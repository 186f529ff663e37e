"""The jitted RL update: PPO-clip on the policy and BCE on the predictor, in one step.

`(state, batch) -> (state, metrics)`, donated state, micro-batches accumulated with `lax.scan`.

Scale-out (see DESIGN.md, "Layout at pod scale"):
- Micro-batches keep the rows split over the (data, fsdp) mesh axes (`parallel.micro_batch`), so
  each device multiplies rows / (data x fsdp x micro_batches) rows per micro-batch.
- `jit_update_step(..., state_shardings, batch_shardings)` fixes in and out shardings and donates
  the state; `state_shardings(state, mesh)` derives them from the parameters' logical axes.
- Layers are rematerialized per `UpdateConfig.remat`.
- Master weights: when the policy's parameters are lower precision than `master_dtype` (bf16 params,
  f32 masters), the state holds f32 masters and f32 Adam moments; the forward pass runs on the
  masters cast to the policy dtype, exactly the weights the sampler gets from `policy_params`.
- LoRA (`jit_update_step(..., lora=True)`, `trace_jax.lora_run`): the state's params are the f32
  adapters (with f32 moments) of a graph with adapters, and the frozen base is a third argument
  of the update, read in its storage dtype and never donated; the forward adds the adapters'
  low-rank products to the base's projections (no merged weight, no dense weight gradient).
- Divergence guard: a step whose loss, gradients or *updated parameters* are not finite, or whose
  update is larger than `max_update_ratio` times the parameters' norm, is skipped inside the jitted
  function: `lax.cond` applies the optimizer only when the would-be update (checked by fused
  reductions, never stored) is good, so no second copy of the state is kept alive. Skips are
  counted in `state["skipped"]`, consecutive ones in `state["skip_streak"]`.

Batch layout (all arrays lead with the batch dimension B; per-token arrays are aligned with
`tokens`, entry t describes token t predicted from position t-1, so entry 0 is always masked):
  tokens      i32[B, T]   root-to-leaf sequences (prompt, turns, observations), right-padded
  segment_ids i32[B, T]   1 on real tokens, 0 on padding (or packed segment ids)
  positions   i32[B, T]
  mask        f32[B, T]   1 on generated, owned tokens to train
  adv         f32[B, T]   per-token advantages
  old_logp    f32[B, T]   sampling-policy log-probs of the tokens
  ref_logp    f32[B, T]   reference log-probs (only read when kl_coef > 0)
  pred_pos    i32[B, K]   positions of prefix ends (node boundaries) in the sequence
  pred_target f32[B, K]   V(y) of those nodes
  pred_weight f32[B, K]   weights (0 on padding or on nodes owned by another sequence)
  pred_pstart i32[B, K]   start of each node's prompt in the row (read with prompt_mean_features)
  pred_plen   i32[B, K]   length of that prompt
Tree-packed batches (`rl.packing=tree`, `trace_jax.rl.batch.build_tree_units`) add
  prev        i32[B, T]   row index of the previous token on each token's root path (its logits
                          predict the token; t - 1 except at a node's first token)
  kv_end      i32[B, T]   end of each token's subtree in the row (the ancestor mask, see the model)
and their positions are depths along the root paths. With `rl.attention=blocked`
(`trace_jax.rl.ppo_loop.pack_rows`) the batch also holds
  kv_blocks      i32[B, nQ, M]  per query block, the key blocks it may see (`kv_block_lists`)
  kv_block_count i32[B, nQ]     how many of them are listed
and every forward of the update (policy, predictor features, reference log-probs) runs the
block-sparse attention instead of the dense [T, T] mask.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from trace_jax.models.qwen3.config import resolve_dtype
from trace_jax.parallel.micro_batch import merge_micro_batches, split_micro_batches
from trace_jax.parallel.sharding import (DEFAULT_RULES, batch_sharding, logical_to_spec,
                                         variable_value)
from trace_jax.rl.losses import (predictor_bce, ppo_clip_loss, token_logprobs,
                                 token_logprobs_and_entropy)

REMAT_CHOICES = ("none", "full", "dots")


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
  lr: float = 1e-5
  predictor_lr: float = 1e-3
  eps_low: float = 0.2
  eps_high: float = 0.28
  kl_coef: float = 0.0
  entropy_coef: float = 0.0
  max_grad_norm: float = 1.0
  weight_decay: float = 0.0
  micro_batches: int = 1
  temperature: float = 1.0
  predictor_weight: float = 1.0
  # Per-layer rematerialization in the update's forward: none | full | dots.
  remat: str = "none"
  # Dtype of the policy weights the sampler runs (the model's param_dtype). None: read it from the
  # model graph (`cfg.param_dtype`), else the masters' own dtype.
  param_dtype: Any = None
  # Masters and Adam moments for lower-precision params ("float32"); None keeps the params' dtype.
  master_dtype: Any = "float32"
  # Predictor features [last state, mean final state over the prompt] (the sampler's
  # `prompt_mean_features`); False: the last state alone.
  prompt_mean_features: bool = False
  # Skip a step whose update norm exceeds this multiple of the parameter norm (0 = off).
  max_update_ratio: float = 1.0

  def __post_init__(self):
    if self.remat not in REMAT_CHOICES:
      raise ValueError(f"UpdateConfig.remat={self.remat!r}; expected one of {REMAT_CHOICES}")
    if self.micro_batches < 1:
      raise ValueError(f"UpdateConfig.micro_batches must be >= 1, got {self.micro_batches}")


def make_optimizers(cfg: UpdateConfig):
  policy = optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm),
                       optax.adamw(cfg.lr, b1=0.9, b2=0.99, weight_decay=cfg.weight_decay))
  predictor = optax.adamw(cfg.predictor_lr, weight_decay=0.0)
  return policy, predictor


# ---- master weights ------------------------------------------------------------------------------
def _cast_floats(tree, dtype):
  dtype = jnp.dtype(resolve_dtype(dtype))

  def cast(x):
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
      return x.astype(dtype)
    return x
  return jax.tree.map(cast, tree)


def to_master(params, master_dtype="float32"):
  """Floating parameters of lower precision than `master_dtype` cast up to it
  (others as they are)."""
  if master_dtype is None:
    return params
  m = jnp.dtype(resolve_dtype(master_dtype))

  def up(x):
    if jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < jnp.finfo(m).bits:
      return x.astype(m)
    return x
  return jax.tree.map(up, params)


def policy_params(state, param_dtype=None):
  """The policy weights for the sampler (and the reference): the masters of `state["params"]` (or a
  params tree) cast to `param_dtype`, e.g. the model config's "bfloat16". None: as stored."""
  params = state["params"] if isinstance(state, dict) and "params" in state else state
  return params if param_dtype is None else _cast_floats(params, param_dtype)


def _policy_dtype(cfg: UpdateConfig, model):
  if cfg.param_dtype is not None:
    return cfg.param_dtype
  mcfg = getattr(model, "cfg", None)
  return getattr(mcfg, "param_dtype", None)


def init_train_state(params, pred_params, cfg: UpdateConfig) -> dict:
  """{"params": masters, "opt", "pred_params", "pred_opt", "step", "skipped", "skip_streak"}.

  With bf16 `params` the masters and the Adam moments are `cfg.master_dtype` (f32); the arrays keep
  the input's sharding.
  """
  popt, qopt = make_optimizers(cfg)
  master = to_master(params, cfg.master_dtype)
  return {"params": master, "opt": popt.init(master), "pred_params": pred_params,
          "pred_opt": qopt.init(pred_params), "step": jnp.zeros((), jnp.int32),
          "skipped": jnp.zeros((), jnp.int32), "skip_streak": jnp.zeros((), jnp.int32)}


# ---- shardings -----------------------------------------------------------------------------------
def _is_var(x):
  return isinstance(x, nnx.Variable)


def state_shardings(state, mesh: Mesh, rules=DEFAULT_RULES):
  """NamedSharding for every leaf of a train state (concrete or abstract): parameters, their
  masters and their optimizer moments by the logical axes the model gave them, everything without
  logical axes (counts, step, scalars) replicated. Same structure as `state`
  (Variables replaced)."""
  def one(x):
    if _is_var(x):
      v = variable_value(x)
      spec = logical_to_spec(getattr(x, "logical_axes", None), rules, mesh, v.shape)
      return NamedSharding(mesh, spec)
    return NamedSharding(mesh, P())
  return jax.tree.map(one, state, is_leaf=_is_var)


def batch_shardings(batch, mesh: Mesh, rules=DEFAULT_RULES):
  """Rows split over the batch mesh axes (data, fsdp), everything else replicated."""
  return jax.tree.map(lambda x: batch_sharding(mesh, max(len(x.shape), 1), rules), batch)


def place_state(state, shardings):
  """device_put every leaf of `state` in its sharding (e.g. after init or restore); on a mesh that
  spans several processes, a leaf held whole by every process is placed shard by shard."""
  if all(s.is_fully_addressable for s in jax.tree.leaves(shardings)):
    return jax.device_put(state, shardings)
  from trace_jax.parallel.distributed import put_global_tree
  return put_global_tree(state, shardings)


def _mesh_of(shardings):
  for s in jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding)):
    if isinstance(s, NamedSharding):
      return s.mesh
  return None


# ---- loss and gradients --------------------------------------------------------------------------
def span_means(hidden, start, length):
  """f32[B, K, D]: the mean of `hidden[b, start[b, k] : start[b, k] + length[b, k]]` (0 for an
  empty span), by differences of one cumulative sum over the sequence (packed rows: a node's
  prompt is its segment's first tokens)."""
  cs = jnp.cumsum(hidden.astype(jnp.float32), axis=1)
  cs = jnp.pad(cs, ((0, 0), (1, 0), (0, 0)))
  hi = jnp.take_along_axis(cs, (start + length)[..., None], axis=1)
  lo = jnp.take_along_axis(cs, start[..., None], axis=1)
  return (hi - lo) / jnp.maximum(length, 1)[..., None].astype(jnp.float32)


def _kv_blocks(mb):
  """(blocks, counts) for `Decoder.forward(kv_blocks=...)` when the batch carries block lists."""
  return (mb["kv_blocks"], mb["kv_block_count"]) if "kv_blocks" in mb else None


def _next_token_logits(model, out, mb):
  """f32[B, T-1, V]: entry t predicts token t + 1. In a tree-packed batch (`prev` present) the
  logits of token t + 1 are those at its root path's previous token, `prev[t + 1]` (the parent's
  last token for a node's first token), not at row index t."""
  if "prev" not in mb:
    return out["logits"][:, :-1]
  src = jnp.take_along_axis(out["hidden"], mb["prev"][:, 1:, None], axis=1)
  return model.logits(src)


def _loss(params, pred_params, graphdef, pred_graphdef, mb, normalizer, pred_norm, cfg,
          base=None):
  if base is not None:  # LoRA: `params` are the f32 adapters on the frozen base (models.lora)
    model = nnx.merge(graphdef, base, params)
  else:
    dtype = _policy_dtype(cfg, nnx.merge(graphdef, params))
    if dtype is not None:  # the forward runs on exactly the weights the sampler runs
      params = _cast_floats(params, dtype)
    model = nnx.merge(graphdef, params)
  out = model.forward(mb["tokens"], positions=mb["positions"], segment_ids=mb["segment_ids"],
                      remat=cfg.remat, kv_end=mb.get("kv_end"), compute_logits="prev" not in mb,
                      kv_blocks=_kv_blocks(mb))
  logp, ent = token_logprobs_and_entropy(_next_token_logits(model, out, mb), mb["tokens"][:, 1:],
                                         cfg.temperature)
  pg, m = ppo_clip_loss(
      logp, mb["old_logp"][:, 1:], mb["adv"][:, 1:], mb["mask"][:, 1:], eps_low=cfg.eps_low,
      eps_high=cfg.eps_high, ref_logp=mb["ref_logp"][:, 1:] if cfg.kl_coef > 0 else None,
      kl_coef=cfg.kl_coef, entropy=ent, entropy_coef=cfg.entropy_coef, normalizer=normalizer)
  feats = jnp.take_along_axis(out["hidden"], mb["pred_pos"][..., None], axis=1)
  if cfg.prompt_mean_features:
    feats = jnp.concatenate([feats.astype(jnp.float32),
                             span_means(out["hidden"], mb["pred_pstart"], mb["pred_plen"])], -1)
  head = nnx.merge(pred_graphdef, pred_params)
  plogits = head(feats)
  w = mb["pred_weight"]
  # Sum-then-divide by the step's total weight so micro-batches add up to the full-batch loss.
  bce = predictor_bce(plogits, mb["pred_target"], w) * jnp.sum(w) / pred_norm
  m = dict(m, predictor_bce=bce)
  return pg + cfg.predictor_weight * bce, m


def make_grad_fn(graphdef, pred_graphdef, cfg: UpdateConfig, mesh: Mesh | None = None,
                 rules=DEFAULT_RULES):
  """Returns grads(state, batch) -> (loss, metrics, (policy_grads, predictor_grads)), with the
  batch split into `cfg.micro_batches` micro-batches (each split over the mesh's row axes) whose
  gradients are summed by `lax.scan`. Gradients are in the masters' dtype. With LoRA, `graphdef`
  has adapters, `state["params"]` holds them and `grads(state, batch, base)` takes the frozen
  base."""
  grad_fn = jax.value_and_grad(_loss, argnums=(0, 1), has_aux=True)

  def grads(state, batch, base=None):
    normalizer = jnp.maximum(jnp.sum(batch["mask"][:, 1:]), 1.0)
    pred_norm = jnp.maximum(jnp.sum(batch["pred_weight"]), 1e-6)
    mbs = split_micro_batches(batch, cfg.micro_batches, mesh, rules)

    def one(mb):
      return grad_fn(state["params"], state["pred_params"], graphdef, pred_graphdef, mb,
                     normalizer, pred_norm, cfg, base)

    def body(acc, mb):
      (loss, m), g = one(mb)
      acc_g, acc_l, acc_m = acc
      return (jax.tree.map(jnp.add, acc_g, g), acc_l + loss, jax.tree.map(jnp.add, acc_m, m)), None

    zeros = jax.tree.map(jnp.zeros_like, (state["params"], state["pred_params"]))
    m0 = jax.eval_shape(lambda: one(jax.tree.map(lambda x: x[0], mbs))[0][1])
    m0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), m0)
    # Every term is normalized by the whole step's token count (or predictor weight), so summing
    # the micro-batches gives the full-batch loss, gradient and token-mean metrics.
    (g, loss, metrics), _ = jax.lax.scan(body, (zeros, jnp.zeros(()), m0), mbs)
    metrics["num_tokens"] = normalizer
    return loss, metrics, g

  return grads


# ---- the update step -----------------------------------------------------------------------------
def _all_finite(tree):
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def make_update_step(graphdef, pred_graphdef, cfg: UpdateConfig, mesh: Mesh | None = None,
                     rules=DEFAULT_RULES, lora: bool = False):
  """Returns update(state, batch) -> (state, metrics), ready for jax.jit with donation; with
  `lora`, update(state, batch, base): `graphdef` is the adapted model's, `state["params"]` its
  adapters (all that is trained, with the predictor) and `base` the frozen base (never donated).

  Metrics (f32 scalars): the loss terms of `ppo_clip_loss`, predictor_bce, num_tokens, loss,
  grad_norm, update_ratio (update norm / parameter norm), finite (1 when loss, gradients and the
  would-be parameters are all finite), skipped (1 when this step was skipped), skip_streak
  (consecutive skipped steps up to and including this one).
  """
  popt, qopt = make_optimizers(cfg)
  grads_fn = make_grad_fn(graphdef, pred_graphdef, cfg, mesh, rules)

  def apply(state, gp, gq):
    up, opt = popt.update(gp, state["opt"], state["params"])
    uq, qopt_state = qopt.update(gq, state["pred_opt"], state["pred_params"])
    return (optax.apply_updates(state["params"], up), opt,
            optax.apply_updates(state["pred_params"], uq), qopt_state)

  def update_lora(state, batch, base):
    loss, metrics, (gp, gq) = grads_fn(state, batch, base)
    gnorm = optax.tree.norm(gp)
    # The would-be update, reduced to a few scalars: XLA fuses these elementwise chains into the
    # reductions, so neither the updates nor the new parameters are stored here.
    new_p, _, new_q, _ = apply(state, gp, gq)
    finite = (jnp.isfinite(loss) & jnp.isfinite(gnorm) & _all_finite(gq) & _all_finite(new_p)
              & _all_finite(new_q))
    delta = jax.tree.map(lambda a, b: a.astype(jnp.float32) - b.astype(jnp.float32), new_p,
                         state["params"])
    ratio = optax.tree.norm(delta) / jnp.maximum(optax.tree.norm(state["params"]), 1e-30)
    ok = finite
    if cfg.max_update_ratio > 0:
      ok = ok & (ratio <= cfg.max_update_ratio)
    keys = ("params", "opt", "pred_params", "pred_opt")
    new = jax.lax.cond(ok, lambda: apply(state, gp, gq), lambda: tuple(state[k] for k in keys))
    new = dict(zip(keys, new))
    skip = (~ok).astype(jnp.int32)
    new["step"] = state["step"] + 1
    new["skipped"] = state["skipped"] + skip
    new["skip_streak"] = (state["skip_streak"] + 1) * skip
    metrics = dict(metrics, loss=loss, grad_norm=gnorm, update_ratio=ratio,
                   finite=finite.astype(jnp.float32), skipped=skip.astype(jnp.float32),
                   skip_streak=new["skip_streak"].astype(jnp.float32),
                   param_norm=optax.tree.norm(new["params"]))
    return new, metrics

  if lora:
    return update_lora

  def update(state, batch):
    return update_lora(state, batch, None)
  return update


def jit_update_step(graphdef, pred_graphdef, cfg: UpdateConfig, state_shardings: Any = None,
                    batch_shardings: Any = None, mesh: Mesh | None = None, rules=DEFAULT_RULES,
                    lora: bool = False, base_shardings: Any = None):
  """jax.jit of the update with the state donated.

  With `state_shardings` (from `state_shardings(state, mesh)`) the state goes in and comes out in
  exactly those shardings; `batch_shardings` (from `batch_shardings(batch, mesh)`)
  fixes the batch's.
  The mesh (for the micro-batch split) is taken from the shardings unless given.
  `lora`: the update takes (state, batch, base) (`make_update_step`), the base in
  `base_shardings` (from `state_shardings(base, mesh)`), read and never donated.
  """
  mesh = mesh if mesh is not None else _mesh_of(state_shardings)
  fn = make_update_step(graphdef, pred_graphdef, cfg, mesh, rules, lora=lora)
  if state_shardings is None:
    return jax.jit(fn, donate_argnums=(0,))
  ins = (state_shardings, batch_shardings) + ((base_shardings,) if lora else ())
  return jax.jit(fn, donate_argnums=(0,), in_shardings=ins,
                 out_shardings=(state_shardings, None))


# ---- KL reference --------------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def _reference_fn(graphdef, micro_batches: int, mesh, rules, temperature: float):
  def f(ref_params, inputs):
    mbs = split_micro_batches(inputs, micro_batches, mesh, rules)

    def body(carry, mb):
      model = nnx.merge(graphdef, ref_params)
      out = model.forward(mb["tokens"], positions=mb["positions"], segment_ids=mb["segment_ids"],
                          kv_end=mb.get("kv_end"), compute_logits="prev" not in mb,
                          kv_blocks=_kv_blocks(mb))
      lp = token_logprobs(_next_token_logits(model, out, mb), mb["tokens"][:, 1:], temperature)
      return carry, jnp.pad(lp, ((0, 0), (1, 0)))
    _, out = jax.lax.scan(body, None, mbs)
    return merge_micro_batches(out, mesh, rules)
  return jax.jit(f)


def reference_logprobs(graphdef, ref_params, batch, micro_batches: int = 1,
                       mesh: Mesh | None = None, rules=DEFAULT_RULES, temperature: float = 1.0):
  """Reference-policy log-probs f32[B, T] of `batch["tokens"]` (entry 0 is 0), on device.

  Runs the reference model over `micro_batches` micro-batches (split like the update's, so each
  device holds B / (shards x micro_batches) rows of logits at a time) inside one jitted `lax.scan`;
  the result stays on device, split over the rows like the batch, ready for `batch["ref_logp"]`.
  Jitted once per (graph, micro_batches, mesh, temperature).
  """
  fn = _reference_fn(graphdef, int(micro_batches), mesh, tuple(rules), float(temperature))
  keys = ("tokens", "positions", "segment_ids", "prev", "kv_end", "kv_blocks", "kv_block_count")
  return fn(ref_params, {k: batch[k] for k in keys if k in batch})
