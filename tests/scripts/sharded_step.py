"""One sharded forward/loss/grad of the tiny model; prints a JSON summary.

Run by tests in a fresh process (device counts must be fixed before JAX starts):
- `--mode compare`: with 8 fake CPU devices, compare mesh (2,2,2) against one device.
- `--mode multiprocess`: one of two processes joined by `trace_jax.parallel.initialize`.
"""

import argparse
import json
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


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--mode", choices=["compare", "multiprocess"], required=True)
  p.add_argument("--coordinator")
  p.add_argument("--num_processes", type=int)
  p.add_argument("--process_id", type=int)
  a = p.parse_args()
  if a.mode == "compare":
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
