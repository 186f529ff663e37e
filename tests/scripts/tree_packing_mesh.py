"""Tree-packed gradients on mesh (2,2,2) against the unpacked layout on one device; prints JSON.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/scripts/tree_packing_mesh.py

Run by tests/test_tree_packing.py in a fresh process with 8 fake CPU devices: random trees with
forks below the root, the tree_grpo estimator, 2 micro-batches split over (data, fsdp), the
ancestor mask and predecessor gather under the model's tensor-parallel layout.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from test_batch import random_tree

from trace_jax.models.predictor import PredictorHead
from trace_jax.models.qwen3 import Qwen3, get_preset
from trace_jax.parallel import make_mesh, shard_batch, shard_state
from trace_jax.rl import update as U
from trace_jax.rl.batch import build_sequences, build_tree_units, pack_batch


def main():
  assert len(jax.devices()) == 8, jax.devices()
  rng = np.random.default_rng(7)
  trees = [random_tree(rng, uid=i, rollouts=int(rng.integers(2, 8))) for i in range(8)]
  row_len, rows = 48, 16  # rows: a multiple of data x fsdp x micro-batches
  seqs, _, _ = build_sequences(trees, "tree_grpo", 8)
  units, _, _ = build_tree_units(trees, "tree_grpo", 8, row_len, 32)
  b_unp, i_unp = pack_batch(seqs, row_len, 32, num_rows=2 * rows)
  b_tree, i_tree = pack_batch(units, row_len, 32, num_rows=rows)
  assert i_unp["dropped_sequences"] == 0 and i_tree["dropped_sequences"] == 0
  mcfg = get_preset("tiny", vocab_size=100, num_layers=2)
  graphdef, params = nnx.split(Qwen3(mcfg, rngs=nnx.Rngs(0)))
  pg, pp = nnx.split(PredictorHead(mcfg.hidden_size, 16, rngs=nnx.Rngs(1)))
  cfg = U.UpdateConfig(micro_batches=2)
  s1 = U.init_train_state(jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, pp), cfg)
  l1, _, g1 = jax.jit(U.make_grad_fn(graphdef, pg, cfg))(s1, b_unp)
  mesh = make_mesh("data:2,fsdp:2,tensor:2")
  s8 = U.init_train_state(shard_state(params, mesh), pp, cfg)
  l8, _, g8 = jax.jit(U.make_grad_fn(graphdef, pg, cfg, mesh))(s8, shard_batch(b_tree, mesh))
  err = max(float(jnp.max(jnp.abs(jnp.asarray(a) - jnp.asarray(b))) /
                  (jnp.max(jnp.abs(jnp.asarray(a))) + 1e-30))
            for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g8)))
  print(json.dumps({"devices": len(jax.devices()), "loss_1": float(l1), "loss_8": float(l8),
                    "loss_rel_err": abs(float(l8) - float(l1)) / abs(float(l1)),
                    "grad_rel_err": err, "packed_tokens": i_tree["tokens"],
                    "unpacked_tokens": i_unp["tokens"]}))


if __name__ == "__main__":
  main()
