"""Compiles the TPU tree-attention kernel ahead of time for v5e, v5p and v6e (needs libtpu, no TPU).

Runs the Mosaic compiler on abstract TPU topologies; prints one "compiled" line per case.
Environment (set by the test): TPU_SKIP_MDS_QUERY=1 TPU_WORKER_HOSTNAMES=localhost.
`--quick`: one sampler-like case per generation; otherwise a sweep over dtypes and head blocks.
"""

import functools
import sys

import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding

from trace_jax.kernels import tree_attention_tpu

TOPOLOGIES = {"v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}


def compile_case(device, dtype, s=64, hkv=8, g=8, d=128, pages=8192, ps=64, ng=8, b=8, pg=64,
                 psuf=16, **opts):
  i32 = jnp.int32
  shapes = [((s, hkv * g, d), dtype), ((pages, ps, hkv, d), dtype), ((pages, ps, hkv, d), dtype),
            ((ng, pg), i32), ((ng,), i32), ((ng, b), i32), ((s, psuf), i32), ((s,), i32)]
  sh = SingleDeviceSharding(device)
  args = [jax.ShapeDtypeStruct(x, t, sharding=sh) for x, t in shapes]
  jax.jit(functools.partial(tree_attention_tpu, **opts)).trace(*args).lower().compile()
  print("compiled", device.device_kind, jnp.dtype(dtype).name, dict(hkv=hkv, ps=ps), opts,
        flush=True)


def main():
  quick = "--quick" in sys.argv
  for name, topo in TOPOLOGIES.items():
    device = topologies.get_topology_desc(platform="tpu", topology_name=topo).devices[0]
    # Local shapes under 4-way tensor parallelism of an 8-KV-head model (Qwen3-8B/14B).
    compile_case(device, jnp.bfloat16, hkv=2, ps=16, block_k=256)
    if not quick:
      for dtype in (jnp.bfloat16, jnp.float32):
        compile_case(device, dtype)
        compile_case(device, dtype, kv_heads_per_block=2)
        compile_case(device, dtype, hkv=1, ps=16, block_k=512)


if __name__ == "__main__":
  main()
