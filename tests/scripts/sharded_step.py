"""One sharded forward/loss/grad of the tiny model; prints a JSON summary.

Run by tests in a fresh process (device counts must be fixed before JAX starts):
- `--mode compare`: with 8 fake CPU devices, compare mesh (2,2,2) against one device.
- `--mode multiprocess`: one of two processes joined by `trace_jax.parallel.initialize`.
- `--mode update`: with 8 fake CPU devices, the RL update step on mesh (2,2,2) against one device:
  per-device matmul rows read from the compiled HLO, loss and gradients, out vs in shardings,
  sharded reference log-probs.
"""

import argparse
import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax.models.qwen3 import Qwen3, get_preset
from trace_jax.parallel import initialize, make_mesh, shard_batch, shard_state


def loss_fn(state, graphdef, tokens):
  model = nnx.merge(graphdef, state)
  logits = model(tokens[:, :-1])
  logp = jax.nn.log_softmax(logits)
  nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
  return nll.mean(), logits


def run(mesh):
  cfg = get_preset("tiny", vocab_size=96, num_layers=2)
  graphdef, state = nnx.split(Qwen3(cfg, rngs=nnx.Rngs(0)))
  tokens = np.random.RandomState(0).randint(0, 96, (8, 12)).astype(np.int32)
  if mesh is not None:
    state = shard_state(state, mesh)
    tokens = shard_batch(tokens, mesh)
  step = jax.jit(jax.value_and_grad(loss_fn, has_aux=True), static_argnums=1)
  (loss, logits), grads = step(state, graphdef, tokens)
  gnorm = jnp.sqrt(sum(jnp.sum(g.astype(jnp.float32) ** 2) for g in jax.tree.leaves(grads)))
  # Gather to every host for printing (process_allgather handles non-addressable shards).
  from jax.experimental import multihost_utils
  logits = multihost_utils.process_allgather(logits, tiled=True)
  return float(loss), float(gnorm), np.asarray(logits), grads


def _attention_rows(hlo: str, t: int, group_t: int) -> list[int]:
  """Leading (rows x kv heads) dim of every attention-score dot `[n, G*T, T]` in per-device HLO."""
  shapes = re.findall(r"= \w+\[(\d+),(\d+),(\d+)\]\{[^}]*\} dot\(", hlo)
  return sorted({int(n) for n, m, k in shapes if int(m) == group_t and int(k) == t})


def _one_device_step(state, grads, cfg):
  import optax
  from trace_jax.rl.update import make_optimizers
  up, _ = make_optimizers(cfg)[0].update(grads[0], state["opt"], state["params"])
  return optax.apply_updates(state["params"], up)


def update_check(rows=16, t=24, k=3, n_micro=2, compare_plain=False, place=True):
  """One RL update on mesh (2,2,2) vs one device (see the module docstring)."""
  from trace_jax.models.predictor import PredictorHead
  from trace_jax.rl import update as U
  from trace_jax.rl.batch import random_batch
  assert len(jax.devices()) == 8, jax.devices()
  batch = random_batch(rows, t, 96, preds=k)
  mcfg = get_preset("tiny", vocab_size=96, num_layers=2)
  graphdef, params = nnx.split(Qwen3(mcfg, rngs=nnx.Rngs(0)))
  pred_graphdef, pred_params = nnx.split(PredictorHead(mcfg.hidden_size, 16, rngs=nnx.Rngs(1)))
  cfg = U.UpdateConfig(lr=1e-3, micro_batches=n_micro)
  mesh = make_mesh("data:2,fsdp:2,tensor:2")
  out = {}

  # One device: loss and gradients.
  # (copies: the sharded state below may alias these buffers, and its step donates them)
  s1 = U.init_train_state(jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, pred_params),
                          cfg)
  l1, _, g1 = jax.jit(U.make_grad_fn(graphdef, pred_graphdef, cfg))(s1, batch)

  # The state as the training loop builds it: params sharded, predictor and counters not placed.
  s8 = U.init_train_state(shard_state(params, mesh), pred_params, cfg)
  b8 = shard_batch(batch, mesh)
  sh = U.state_shardings(s8, mesh)
  bsh = U.batch_shardings(batch, mesh)
  l8, _, g8 = jax.jit(U.make_grad_fn(graphdef, pred_graphdef, cfg, mesh))(s8, b8)
  out["loss_1"], out["loss_8"] = float(l1), float(l8)
  out["max_grad_diff"] = max(float(jnp.abs(jnp.asarray(x) - jnp.asarray(y)).max())
                             for x, y in zip(jax.tree.leaves(g1), jax.tree.leaves(g8)))

  # Per-device rows of the attention matmuls in the compiled update (kv heads split over tensor).
  step = U.jit_update_step(graphdef, pred_graphdef, cfg, sh, bsh)
  hlo = step.lower(s8, b8).compile().as_text()
  kv_per_device = mcfg.num_kv_heads // mesh.shape["tensor"]
  out["expected_rows_per_device"] = rows // (mesh.shape["data"] * mesh.shape["fsdp"]) // n_micro
  out["attention_rows_per_device"] = [n // kv_per_device
                                      for n in _attention_rows(hlo, t, mcfg.gqa_group * t)]
  if compare_plain:  # the plain reshape split (no mesh given), for the record
    plain = jax.jit(U.make_update_step(graphdef, pred_graphdef, cfg), in_shardings=(sh, bsh),
                    out_shardings=(sh, None))
    out["plain_split_rows_per_device"] = [
        n // kv_per_device for n in _attention_rows(plain.lower(s8, b8).compile().as_text(), t,
                                                    mcfg.gqa_group * t)]

  # One step: outputs come back in the input shardings, and match one device's step.
  want = jax.tree.leaves(sh)
  if place:
    s8 = U.place_state(s8, sh)
  s8, m8 = step(s8, b8)
  got = jax.tree.leaves(s8)
  out["out_shardings_equal"] = len(want) == len(got) and all(
      w.is_equivalent_to(x.sharding, x.ndim) for w, x in zip(want, got))
  out["n_state_leaves"] = len(got)
  out["sharded_leaves"] = sum(1 for x in got if any(a is not None for a in x.sharding.spec))
  out["max_param_diff_after_step"] = max(  # same step on one device, from g1
      float(jnp.abs(jnp.asarray(x) - jnp.asarray(y)).max())
      for x, y in zip(jax.tree.leaves(_one_device_step(s1, g1, cfg)),
                      jax.tree.leaves(s8["params"])))
  out["skipped_8"] = float(m8["skipped"])
  cache_size = getattr(step, "_cache_size", lambda: 1)  # private jit API; absent: not checked
  out["cache_size_1"] = cache_size()
  s8, _ = step(s8, b8)  # a second call reuses the compiled step (shardings stable)
  out["cache_size_2"] = cache_size()

  # Reference log-probs: micro-batched on device, split over the rows like the batch.
  ref = U.reference_logprobs(graphdef, s8["params"], b8, micro_batches=n_micro, mesh=mesh)
  ref1 = U.reference_logprobs(graphdef, s8["params"], batch, micro_batches=1)
  out["ref_sharding_ok"] = ref.sharding.is_equivalent_to(bsh["tokens"], 2)
  out["ref_max_diff"] = float(np.abs(np.asarray(ref) - np.asarray(ref1)).max())
  return out


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--mode", choices=["compare", "multiprocess", "update"], required=True)
  p.add_argument("--compare_plain", action="store_true")
  p.add_argument("--no_place", action="store_true")
  p.add_argument("--coordinator")
  p.add_argument("--num_processes", type=int)
  p.add_argument("--process_id", type=int)
  a = p.parse_args()
  if a.mode == "update":
    print(json.dumps(update_check(compare_plain=a.compare_plain, place=not a.no_place)))
  elif a.mode == "compare":
    assert len(jax.devices()) == 8, jax.devices()
    l1, g1, lg1, gr1 = run(None)
    mesh = make_mesh("data:2,fsdp:2,tensor:2")
    l8, g8, lg8, gr8 = run(mesh)
    max_grad_diff = max(float(jnp.abs(jnp.asarray(a) - jnp.asarray(b)).max())
                        for a, b in zip(jax.tree.leaves(gr1), jax.tree.leaves(gr8)))
    sharded = [str(x.sharding.spec) for x in jax.tree.leaves(gr8)][:4]
    # HF export, then import straight into the mesh: every tensor lands in its logical sharding.
    import tempfile
    from trace_jax.models.qwen3 import from_pretrained, save_pretrained
    from trace_jax.parallel import state_shardings
    model = Qwen3(get_preset("tiny", vocab_size=96, num_layers=2), rngs=nnx.Rngs(0))
    path = tempfile.mkdtemp()
    save_pretrained(model, path)
    loaded = from_pretrained(path, mesh=mesh)
    want = jax.tree.leaves(state_shardings(nnx.state(loaded), mesh))
    got = [x.sharding for x in jax.tree.leaves(nnx.state(loaded))]
    load_ok = all(a.is_equivalent_to(b, x.ndim) for a, b, x in
                  zip(want, got, jax.tree.leaves(nnx.state(loaded))))
    load_diff = max(float(jnp.abs(a - b).max()) for a, b in
                    zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(loaded))))
    print(json.dumps(dict(loss_1=l1, loss_8=l8, gnorm_1=g1, gnorm_8=g8,
                          max_logit_diff=float(np.abs(lg1 - lg8).max()),
                          max_grad_diff=max_grad_diff, specs=sharded, load_sharded_ok=load_ok,
                          load_max_diff=load_diff)))
  else:
    initialize(a.coordinator, a.num_processes, a.process_id)
    mesh = make_mesh("data:-1,fsdp:1,tensor:1")
    loss, gnorm, logits, _ = run(mesh)
    print(json.dumps(dict(process=jax.process_index(), devices=jax.device_count(),
                          loss=loss, gnorm=gnorm, logit_sum=float(logits.sum()))))
  sys.stdout.flush()


if __name__ == "__main__":
  main()
