"""The jitted RL update: PPO-clip on the policy and BCE on the predictor, in one step.

`(state, batch) -> (state, metrics)`, donated state, micro-batches accumulated with `lax.scan`.
A step whose loss or gradients are not finite is skipped inside the jitted function (the previous
state is kept) and counted in `state["skipped"]`.

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
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from trace_jax.rl.losses import predictor_bce, ppo_clip_loss, token_logprobs_and_entropy


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


def make_optimizers(cfg: UpdateConfig):
  policy = optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm),
                       optax.adamw(cfg.lr, b1=0.9, b2=0.99, weight_decay=cfg.weight_decay))
  predictor = optax.adamw(cfg.predictor_lr, weight_decay=0.0)
  return policy, predictor


def init_train_state(params, pred_params, cfg: UpdateConfig) -> dict:
  popt, qopt = make_optimizers(cfg)
  return {"params": params, "opt": popt.init(params), "pred_params": pred_params,
          "pred_opt": qopt.init(pred_params), "step": jnp.zeros((), jnp.int32),
          "skipped": jnp.zeros((), jnp.int32)}


def _loss(params, pred_params, graphdef, pred_graphdef, mb, normalizer, pred_norm, cfg):
  model = nnx.merge(graphdef, params)
  out = model.forward(mb["tokens"], positions=mb["positions"], segment_ids=mb["segment_ids"])
  logp, ent = token_logprobs_and_entropy(out["logits"][:, :-1], mb["tokens"][:, 1:],
                                         cfg.temperature)
  pg, m = ppo_clip_loss(
      logp, mb["old_logp"][:, 1:], mb["adv"][:, 1:], mb["mask"][:, 1:], eps_low=cfg.eps_low,
      eps_high=cfg.eps_high, ref_logp=mb["ref_logp"][:, 1:] if cfg.kl_coef > 0 else None,
      kl_coef=cfg.kl_coef, entropy=ent, entropy_coef=cfg.entropy_coef, normalizer=normalizer)
  feats = jnp.take_along_axis(out["hidden"], mb["pred_pos"][..., None], axis=1)
  head = nnx.merge(pred_graphdef, pred_params)
  plogits = head(feats)
  w = mb["pred_weight"]
  # Sum-then-divide by the step's total weight so micro-batches add up to the full-batch loss.
  bce = predictor_bce(plogits, mb["pred_target"], w) * jnp.sum(w) / pred_norm
  m = dict(m, predictor_bce=bce)
  return pg + cfg.predictor_weight * bce, m


def make_grad_fn(graphdef, pred_graphdef, cfg: UpdateConfig):
  """Returns grads(state, batch) -> (loss, metrics, (policy_grads, predictor_grads)), with the
  batch split into `cfg.micro_batches` micro-batches whose gradients are summed by `lax.scan`."""
  grad_fn = jax.value_and_grad(_loss, argnums=(0, 1), has_aux=True)

  def grads(state, batch):
    b = batch["tokens"].shape[0]
    n_micro = cfg.micro_batches
    if b % n_micro:
      raise ValueError(f"batch size {b} is not divisible by micro_batches={n_micro}")
    normalizer = jnp.maximum(jnp.sum(batch["mask"][:, 1:]), 1.0)
    pred_norm = jnp.maximum(jnp.sum(batch["pred_weight"]), 1e-6)
    mbs = jax.tree.map(lambda x: x.reshape((n_micro, b // n_micro) + x.shape[1:]), batch)

    def one(mb):
      return grad_fn(state["params"], state["pred_params"], graphdef, pred_graphdef, mb,
                     normalizer, pred_norm, cfg)

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


def make_update_step(graphdef, pred_graphdef, cfg: UpdateConfig):
  """Returns update(state, batch) -> (state, metrics), ready for jax.jit with donation."""
  popt, qopt = make_optimizers(cfg)
  grads_fn = make_grad_fn(graphdef, pred_graphdef, cfg)

  def update(state, batch):
    loss, metrics, (gp, gq) = grads_fn(state, batch)
    gnorm = optax.tree.norm(gp)
    finite = jnp.isfinite(loss) & jnp.isfinite(gnorm) & jnp.isfinite(optax.tree.norm(gq))
    up, opt = popt.update(gp, state["opt"], state["params"])
    uq, qopt_state = qopt.update(gq, state["pred_opt"], state["pred_params"])
    new = {"params": optax.apply_updates(state["params"], up), "opt": opt,
           "pred_params": optax.apply_updates(state["pred_params"], uq), "pred_opt": qopt_state}
    old = {k: state[k] for k in new}
    new = jax.tree.map(lambda a, o: jnp.where(finite, a, o), new, old)
    new["step"] = state["step"] + 1
    new["skipped"] = state["skipped"] + (~finite).astype(jnp.int32)
    metrics = dict(metrics, loss=loss, grad_norm=gnorm, finite=finite.astype(jnp.float32))
    return new, metrics

  return update


def jit_update_step(graphdef, pred_graphdef, cfg: UpdateConfig, state_shardings: Any = None,
                    batch_shardings: Any = None):
  """jax.jit of the update with the state donated; with shardings, outputs keep the state's."""
  fn = make_update_step(graphdef, pred_graphdef, cfg)
  if state_shardings is None:
    return jax.jit(fn, donate_argnums=(0,))
  return jax.jit(fn, donate_argnums=(0,), in_shardings=(state_shardings, batch_shardings),
                 out_shardings=(state_shardings, None))
