"""Per-device memory on paper: parameters, optimizer state, gradients, KV pool, activations.

Everything comes from `nnx.eval_shape` and the logical sharding rules on an abstract mesh, so
planning a 14B model allocates nothing.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from flax import nnx

from trace_jax.models.qwen3 import Qwen3, Qwen3Config
from trace_jax.parallel.sharding import DEFAULT_RULES, logical_to_spec, parse_mesh_spec

GB = 1e9


@dataclasses.dataclass(frozen=True)
class _MeshShape:
  """Stands in for a Mesh where only axis sizes matter."""
  shape: dict


@dataclasses.dataclass
class MemoryPlan:
  mesh: dict
  params_gb: float
  grads_gb: float
  optimizer_gb: float
  kv_pool_gb: float
  activations_gb: float
  n_params: int
  replicated_fallbacks: int

  @property
  def total_gb(self) -> float:
    return (self.params_gb + self.grads_gb + self.optimizer_gb + self.kv_pool_gb +
            self.activations_gb)


def _spec_factor(spec, mesh) -> int:
  f = 1
  for axes in spec:
    if axes is None:
      continue
    for a in (axes,) if isinstance(axes, str) else axes:
      f *= mesh.shape[a]
  return f


def plan_memory(cfg: Qwen3Config, mesh_spec, *, num_pages: int, page_size: int,
                micro_batch_seqs: int, seq_len: int, rules=DEFAULT_RULES,
                optimizer_bytes_per_param: int = 8) -> MemoryPlan:
  """Per-device bytes of one training + sampling process on a (data, fsdp, tensor) mesh.

  micro_batch_seqs: sequences per micro-batch over the whole mesh (split over data x fsdp).
  Activations assume per-layer rematerialization: the residual stream of every layer is kept, plus
  one layer's working set and the f32 logits of the micro-batch.
  """
  sizes = parse_mesh_spec(mesh_spec)
  if any(s < 1 for s in sizes.values()):
    raise ValueError(f"plan needs explicit mesh sizes, got {sizes}")
  mesh = _MeshShape(sizes)
  abstract = nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0)))
  pbytes = np.dtype(cfg.param_dtype).itemsize
  params = n_params = fallbacks = 0
  opt = 0.0
  for _, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
    sds = v.get_value() if hasattr(v, "get_value") else v.value
    n = math.prod(sds.shape)
    axes = v.logical_axes
    spec = logical_to_spec(axes, rules, mesh, sds.shape)
    if spec != logical_to_spec(axes, rules, mesh):
      fallbacks += 1
    f = _spec_factor(spec, mesh)
    n_params += n
    params += n * pbytes / f
    opt += n * optimizer_bytes_per_param / f
  kv_shard = min(sizes["tensor"], cfg.num_kv_heads) if cfg.num_kv_heads % sizes["tensor"] == 0 \
      else 1
  kv = (num_pages * page_size * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim *
        np.dtype(cfg.dtype).itemsize / kv_shard)
  dp = sizes["data"] * sizes["fsdp"]
  tok = max(micro_batch_seqs // dp, 1) * seq_len
  t = sizes["tensor"]
  act_b = np.dtype(cfg.dtype).itemsize
  residual = cfg.num_layers * tok * cfg.hidden_size * act_b
  layer = tok * (4 * cfg.hidden_size + 3 * cfg.intermediate_size / t +
                 2 * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim / t) * act_b
  logits = tok * cfg.vocab_size / t * 4 * 2  # f32 logits and their log-softmax
  return MemoryPlan(mesh=sizes, params_gb=params / GB, grads_gb=params / GB,
                    optimizer_gb=opt / GB, kv_pool_gb=kv / GB,
                    activations_gb=(residual + layer + logits) / GB, n_params=n_params,
                    replicated_fallbacks=fallbacks)


CANDIDATE_MESHES = ("data:1,fsdp:1,tensor:1", "data:1,fsdp:1,tensor:2", "data:1,fsdp:1,tensor:4",
                    "data:1,fsdp:1,tensor:8", "data:1,fsdp:2,tensor:8", "data:1,fsdp:4,tensor:8",
                    "data:2,fsdp:4,tensor:8", "data:1,fsdp:8,tensor:8", "data:1,fsdp:16,tensor:8")
DEVICE_GB = (16, 80, 141)


def format_table(plans: list[MemoryPlan], device_gb=DEVICE_GB, headroom: float = 0.9) -> str:
  head = (f"{'mesh (data,fsdp,tensor)':<24}{'devices':>8}{'params':>9}{'grads':>8}{'optim':>8}"
          f"{'kv pool':>9}{'activ.':>8}{'total GB':>10}  " +
          "  ".join(f"fits {g}GB" for g in device_gb))
  rows = [head, "-" * len(head)]
  for p in plans:
    m = p.mesh
    ndev = m["data"] * m["fsdp"] * m["tensor"]
    fits = "  ".join(f"{'yes' if p.total_gb <= g * headroom else 'no':>9}" for g in device_gb)
    rows.append(f"{str((m['data'], m['fsdp'], m['tensor'])):<24}{ndev:>8}{p.params_gb:>9.2f}"
                f"{p.grads_gb:>8.2f}{p.optimizer_gb:>8.2f}{p.kv_pool_gb:>9.2f}"
                f"{p.activations_gb:>8.2f}{p.total_gb:>10.2f}  {fits}")
  return "\n".join(rows)


