"""Sharded tree attention on 8 fake CPU devices, mesh (data 2, fsdp 2, tensor 2); prints JSON.

Run by tests in a fresh process (the device count is fixed before JAX starts). Two trees, one per
data shard, with global page and slot ids; compares against the single-device reference.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from test_tree_attention import make_tree

from trace_jax.kernels import tree_attention_reference, tree_attention_sharded
from trace_jax.parallel import make_mesh


def global_args():
  shards = [make_tree(s, num_slots=4, num_kv_heads=2, q_per_kv=2, num_groups=2, branches=2)
            for s in (0, 1)]
  a, b = (t.args for t in shards)
  pages, slots = a[1].shape[0], a[0].shape[0]
  b = list(b)
  b[3], b[6] = b[3] + pages, b[6] + pages  # global page ids
  b[5] = jnp.where(b[5] >= 0, b[5] + slots, -1)  # global slot ids
  return tuple(jnp.concatenate([x, y]) for x, y in zip(a, b))


def main():
  impl = sys.argv[1]
  mesh = make_mesh("data:2,fsdp:2,tensor:2")
  args = global_args()
  expected = tree_attention_reference(*args)
  f = jax.jit(lambda *a: tree_attention_sharded(*a, mesh=mesh, impl=impl))
  hlo = f.lower(*args).compile().as_text()
  out = f(*args)
  print(json.dumps(dict(
      max_err=float(jnp.abs(out - expected).max()),
      finite=bool(np.isfinite(np.asarray(out)).all()),
      all_gathers=hlo.count("all-gather"),
      out_sharding=list(out.sharding.spec),  # its axes (a spec's repr differs by version)
  )))


if __name__ == "__main__":
  main()
