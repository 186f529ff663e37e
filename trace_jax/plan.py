"""Per-device memory on paper, term by term, from the layouts the code uses.

Nothing is allocated: parameter shapes come from `nnx.eval_shape`, their per-device split from the
same logical rules (`parallel.sharding.logical_to_spec`) the update's `state_shardings` uses.

What the code lays out (trace_jax/rl/update.py, trace_jax/train.py, trace_jax/sampling/):
- Train state (`init_train_state`): masters in `master_dtype` (f32) when the params are of lower
  precision (bf16), AdamW moments mu and nu in the masters' dtype, the predictor head (f32,
  replicated) and its AdamW moments, all sharded by the parameters' logical axes.
- Other weight copies alive during a run: the sampler's policy weights (`policy_params`, the
  masters cast to param_dtype, held by the engine between steps), the KL reference (one copy in
  param_dtype when kl_coef > 0) and `Run.init_params` (the warm-started params in param_dtype, kept
  by `train.build` for `init_state`).
- The update step (`jit_update_step`, state donated, so its outputs alias its arguments): the
  batch (rows split over data x fsdp), the f32 gradient accumulator of the micro-batch scan plus
  one micro-batch's gradients, the param_dtype cast of the masters the forward runs on, the
  activations of one micro-batch of rows / (data x fsdp x micro_batches) rows with the configured
  remat, one layer's working set including the f32 attention scores [B, Hkv, G*T, T] (no flash
  path in the training forward: `dense_attention`), and the f32 logits [tokens, V / tensor].
- The `lax.cond` non-finite guard computes the would-be update inside reductions only, so it adds
  no second state (nothing is counted for it).
- KV pool (`paged_kv.init_pool`): per layer k and v [num_pages, page_size, Hkv, hd] in the compute
  dtype. On `main` the engine builds it with `jnp.zeros` outside any mesh (an uncommitted array),
  and its first jitted prefill lets XLA choose its sharding: propagated from the k/v projections,
  the KV heads split over `tensor` (`P(None, None, "tensor")`, when tensor divides the KV heads)
  and every page is replicated over data x fsdp. `kv_pool="main"` (the default) plans exactly that.
  `kv_pool="sharded"` plans the layout of `SamplerEngine(mesh=...)`, which the train loop now uses:
  pages split over data x fsdp (one page range per shard), KV heads over `tensor`.
  `kv_pool="replicated"`: a full pool on every device.

Figures are bytes per device; GB = 1e9 bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
from flax import nnx

from trace_jax.models.decoder import Decoder
from trace_jax.models.decoder_config import DecoderConfig, resolve_dtype
from trace_jax.parallel.sharding import (DEFAULT_RULES, logical_to_spec, parse_mesh_spec,
                                         variable_value)

GB = 1e9
F32 = 4
# Per-device f32 buffers of one micro-batch's logits [tokens, V / tensor] alive together in the
# update (read off XLA's buffer assignment): the logits, their shifted slice [:, :-1], the exp of
# the log-softmax (entropy), the cotangent and the cotangent padded back to T; plus the lm_head
# product's partial sums, which the SPMD partitioner computes for the rows of the whole fsdp group
# (the contraction dim, embed, is split over fsdp) before reducing them: `5 + fsdp` buffers.
LOGIT_BUFFERS = 5


@dataclasses.dataclass(frozen=True)
class _MeshShape:
  """Stands in for a Mesh where only axis sizes matter."""
  shape: dict


def _nbytes(dtype) -> int:
  return np.dtype(resolve_dtype(dtype)).itemsize


def _spec_factor(spec, sizes) -> int:
  f = 1
  for axes in spec:
    if axes is None:
      continue
    for a in (axes,) if isinstance(axes, str) else axes:
      f *= sizes[a]
  return f


@dataclasses.dataclass
class ParamLayout:
  """Per-device elements of the model's parameters in the logical sharding."""
  n_params: int             # all elements
  per_device: float         # elements on one device
  replicated_fallbacks: int  # parameters a mesh axis could not split (left replicated)


def param_layout(cfg: DecoderConfig, sizes: dict, rules=DEFAULT_RULES) -> ParamLayout:
  return _param_layout(cfg, tuple(sorted(sizes.items())), tuple(rules))


@functools.lru_cache(maxsize=256)
def _param_layout(cfg, sizes, rules) -> ParamLayout:
  return _layout(_abstract_model(cfg), dict(sizes), rules)


@functools.lru_cache(maxsize=8)
def _abstract_model(cfg):
  return nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))  # every family's parameters


def _layout(abstract, sizes: dict, rules) -> ParamLayout:
  mesh = _MeshShape(sizes)
  n = per = fallbacks = 0
  for _, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
    sds = variable_value(v)
    k = math.prod(sds.shape)
    axes = v.logical_axes
    spec = logical_to_spec(axes, rules, mesh, sds.shape)
    if spec != logical_to_spec(axes, rules, mesh):
      fallbacks += 1
    n += k
    per += k / _spec_factor(spec, sizes)
  return ParamLayout(n, per, fallbacks)


def predictor_layout(hidden_size: int, predictor_hidden: int, sizes: dict,
                     rules=DEFAULT_RULES) -> float:
  """Per-device elements of `PredictorHead(hidden_size, predictor_hidden)` (f32)."""
  return _predictor_layout(hidden_size, predictor_hidden, tuple(sorted(sizes.items())),
                           tuple(rules))


@functools.lru_cache(maxsize=256)
def _predictor_layout(hidden_size, predictor_hidden, sizes, rules) -> float:
  from trace_jax.models.predictor import PredictorHead
  return _layout(nnx.eval_shape(lambda: PredictorHead(hidden_size, predictor_hidden,
                                                      rngs=nnx.Rngs(0))), dict(sizes),
                 rules).per_device


def lora_layout(cfg: DecoderConfig, sizes: dict, rank: int, targets: str = "all",
                rules=DEFAULT_RULES) -> float:
  """Per-device elements of the LoRA adapters (A and B, f32) of `cfg` at `rank` on `targets`
  (`models.lora`), sharded by their base's logical axes."""
  return _lora_layout(cfg, tuple(sorted(sizes.items())), rank, targets, tuple(rules))


@functools.lru_cache(maxsize=16)
def _abstract_adapters(cfg, rank, targets):
  from trace_jax.models import lora

  def adapted():
    return lora.attach(Decoder(cfg, rngs=nnx.Rngs(0)), rank, 2.0 * rank, targets, nnx.Rngs(1))
  return nnx.to_flat_state(nnx.state(nnx.eval_shape(adapted), nnx.LoRAParam))


@functools.lru_cache(maxsize=256)
def _lora_layout(cfg, sizes, rank, targets, rules) -> float:
  mesh, per = _MeshShape(dict(sizes)), 0.0
  for _, v in _abstract_adapters(cfg, rank, targets):
    sds = variable_value(v)
    per += math.prod(sds.shape) / _spec_factor(
        logical_to_spec(v.logical_axes, rules, mesh, sds.shape), dict(sizes))
  return per


def master_dtype_of(param_dtype, master_dtype="float32"):
  """The masters' dtype `update.to_master` gives params of `param_dtype`."""
  if master_dtype is None:
    return resolve_dtype(param_dtype)
  p, m = np.dtype(resolve_dtype(param_dtype)), np.dtype(resolve_dtype(master_dtype))
  return m if p.itemsize < m.itemsize else p


def _kv_split(cfg: DecoderConfig, sizes: dict) -> int:
  t = sizes["tensor"]
  return t if t > 1 and cfg.num_kv_heads % t == 0 else 1


def _heads_split(n: int, t: int) -> int:
  return t if t > 1 and n % t == 0 else 1


# ---- activations of one micro-batch ------------------------------------------------------------
def layer_bytes(cfg: DecoderConfig, sizes: dict, rows: int, seq_len: int, act_bytes: int,
                what: str) -> float:
  """Bytes per device of one decoder layer for `rows` rows of `seq_len` tokens (per device).

  what:
    "saved"   everything the backward reads when nothing is rematerialized: the layer input, both
              norms' outputs, q, k, v (projected and after norm + rope), the attention output, the
              residual after attention, gate, up, silu(gate) * up, and two f32 score tensors
              [B, Hkv, G*T, T] (the masked scores and the softmax) per device.
    "dots"    what `remat="dots"` keeps (`dots_with_no_batch_dims_saveable`): the layer input and
              the outputs of the weight matmuls (q, k, v, o_proj, gate, up, down); scores are
              recomputed.
    "input"   what `remat="full"` keeps: the layer input.
    "working" the transient set of one layer's backward: its saved set, the same again for the
              cotangents, and one more f32 score tensor.
  """
  t = sizes["tensor"]
  tok = rows * seq_len
  d, f = cfg.hidden_size, cfg.intermediate_size / _heads_split(cfg.intermediate_size, t)
  q = cfg.num_heads * cfg.head_dim / _heads_split(cfg.num_heads, t)
  kv = cfg.num_kv_heads * cfg.head_dim / _kv_split(cfg, sizes)
  scores = rows * cfg.num_heads / _heads_split(cfg.num_heads, t) * seq_len * seq_len * F32
  if what == "input":
    return tok * d * act_bytes
  if what == "dots":
    return tok * (3 * d + q + 2 * kv + 2 * f) * act_bytes
  saved = tok * (5 * d + 3 * q + 4 * kv + 3 * f) * act_bytes + 2 * scores
  if what == "saved":
    return saved
  if what == "working":
    return 2 * saved + scores
  raise ValueError(f"layer_bytes(what={what!r})")


def activation_bytes(cfg: DecoderConfig, sizes: dict, rows: int, seq_len: int, remat: str,
                     act_bytes: int) -> float:
  """Peak activation bytes per device of one micro-batch's forward + backward, for the update's
  `remat` ("none" | "dots" | "full"): every layer's kept set plus one layer's working set."""
  lb = functools.partial(layer_bytes, cfg, sizes, rows, seq_len, act_bytes)
  if remat == "none":
    return cfg.num_layers * lb("saved") + lb("working") - lb("saved")
  keep = {"dots": "dots", "full": "input"}[remat]
  return cfg.num_layers * lb(keep) + lb("working")


def logits_bytes(cfg: DecoderConfig, sizes: dict, tokens: int) -> float:
  """f32 logits buffers of one micro-batch per device (see LOGIT_BUFFERS)."""
  v = cfg.vocab_size / _heads_split(cfg.vocab_size, sizes["tensor"])
  return (LOGIT_BUFFERS + sizes["fsdp"]) * tokens * v * F32


# ---- the two jitted steps ----------------------------------------------------------------------
@dataclasses.dataclass
class StepPlan:
  """Bytes per device of one jitted step, in the terms of `compiled.memory_analysis()`."""
  terms: dict      # name -> bytes
  argument: float  # what the step's arguments hold on the device
  output: float    # its outputs (donated ones alias the arguments)
  alias: float     # output bytes written into donated argument buffers

  @property
  def temp(self) -> float:
    return self.total - self.argument - self.output + self.alias

  @property
  def total(self) -> float:
    """argument + output + temp - alias: the step's whole footprint on one device."""
    return sum(self.terms.values())


def plan_update_step(cfg: DecoderConfig, mesh_spec, *, rows: int, seq_len: int, micro_batches: int,
                     remat: str = "none", preds_per_row: int = 18, master_dtype="float32",
                     predictor_hidden: int = 256, act_dtype=None, packing: str = "none",
                     lora_rank: int = 0, lora_targets: str = "all",
                     rules=DEFAULT_RULES) -> StepPlan:
  """The update step as `train.build` jits it (`jit_update_step` with `state_shardings`, state
  donated). rows: the packed batch's rows (all devices), the largest of the run's row buckets
  with `packing="tree"`; act_dtype: the activations' dtype (default cfg.dtype). Tree packing adds
  two i32 per token to the batch (`prev`, `kv_end`) and the final hidden states gathered at each
  token's predecessor (and their gradient) to the activations.
  lora_rank > 0 (`model.lora`): the state is the f32 adapters with their moments, the frozen base
  an argument in param_dtype (never donated), gradients the adapters' only, no cast copy; the
  activations add each adapted projection's x A [tokens, r]."""
  sizes = _sizes(mesh_spec)
  dp = sizes["data"] * sizes["fsdp"]
  if rows % (dp * micro_batches):
    raise ValueError(f"rows={rows} is not divisible by data x fsdp x micro_batches = "
                     f"{dp} x {micro_batches} (the micro-batch split needs whole rows per shard)")
  lay = param_layout(cfg, sizes, rules)
  mb = _nbytes(master_dtype_of(cfg.param_dtype, master_dtype))
  pb = _nbytes(cfg.param_dtype)
  ab = _nbytes(act_dtype or cfg.dtype)
  npred = predictor_layout(cfg.hidden_size, predictor_hidden, sizes, rules)
  state = lay.per_device * 3 * mb + npred * 3 * F32
  rows_dev = rows // dp
  batch = rows_dev * (seq_len * (3 * 4 + 4 * F32) + preds_per_row * (4 + 2 * F32))
  rows_mb = rows_dev // micro_batches
  if packing == "tree":
    batch += rows_dev * seq_len * 2 * 4
  terms = {
      "state (masters + AdamW mu, nu)": state,
      "batch": batch,
      "grads (accumulator + one micro-batch)": 2 * (lay.per_device * mb + npred * F32),
      "policy cast of the masters": lay.per_device * pb if pb != mb else 0.0,
      f"activations (remat={remat})": activation_bytes(cfg, sizes, rows_mb, seq_len, remat, ab),
      "logits (f32)": logits_bytes(cfg, sizes, rows_mb * seq_len),
  }
  if packing == "tree":
    terms["tree packing: hidden at each token's predecessor (+ grad)"] = (
        2 * rows_mb * seq_len * cfg.hidden_size * ab)
  if lora_rank > 0:
    from trace_jax.models.lora import parse_targets

    ad = lora_layout(cfg, sizes, lora_rank, lora_targets, rules)
    state = ad * 3 * F32 + npred * 3 * F32
    base = lay.per_device * pb
    terms["state (masters + AdamW mu, nu)"] = state
    terms["frozen base (param_dtype)"] = base
    terms["grads (accumulator + one micro-batch)"] = 2 * (ad + npred) * F32
    terms["policy cast of the masters"] = 0.0
    n_targets = len(parse_targets(lora_targets))
    terms["LoRA x A per adapted projection"] = (cfg.num_layers * n_targets * rows_mb * seq_len
                                                * lora_rank * ab)
    return StepPlan(terms, argument=state + batch + base, output=state, alias=state)
  return StepPlan(terms, argument=state + batch, output=state, alias=state)


KV_POOL_LAYOUTS = ("main", "sharded", "replicated")


def kv_pool_split(cfg: DecoderConfig, sizes: dict, kv_pool: str = "main") -> int:
  """Into how many pieces the pool is split per device (see the module docstring)."""
  if kv_pool not in KV_POOL_LAYOUTS:
    raise ValueError(f"kv_pool={kv_pool!r}; expected one of {KV_POOL_LAYOUTS}")
  if kv_pool == "replicated":
    return 1
  pages = sizes["data"] * sizes["fsdp"] if kv_pool == "sharded" else 1
  return pages * _kv_split(cfg, sizes)


def kv_pool_bytes(cfg: DecoderConfig, sizes: dict, *, num_pages: int, page_size: int,
                  kv_pool: str = "main", kv_dtype=None) -> float:
  """Per-device bytes of the paged KV pool in the layout `kv_pool`."""
  full = (num_pages * page_size * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim *
          _nbytes(kv_dtype or cfg.dtype))
  return full / kv_pool_split(cfg, sizes, kv_pool)


def plan_decode_step(cfg: DecoderConfig, mesh_spec, *, num_slots: int, num_pages: int,
                     page_size: int, max_seq_len: int, kv_pool: str = "main",
                     group_size: int | None = None, num_groups: int | None = None,
                     kv_dtype=None, rules=DEFAULT_RULES) -> StepPlan:
  """The sampler's jitted decode step (`engine_ops.make_decode_step`, pool donated) with the tree
  tables at their widest bucket (max_seq_len / page_size pages per group and per suffix).

  Temporaries (the larger of the two, they are not alive together): one layer's attention, i.e.
  the pages gathered for every group and every slot suffix (k in the pool's dtype, v cast to f32)
  and its f32 scores and exps; or the f32 logits of the slots over the whole vocabulary with their
  softmax, exp and cumulative sums (4 buffers [slots, vocab])."""
  sizes = _sizes(mesh_spec)
  lay = param_layout(cfg, sizes, rules)
  params = lay.per_device * _nbytes(cfg.param_dtype)
  pool = kv_pool_bytes(cfg, sizes, num_pages=num_pages, page_size=page_size,
                       kv_pool=kv_pool, kv_dtype=kv_dtype)
  gs = group_size or min(num_slots, 8)
  ng = num_groups or max(1, -(-2 * num_slots // gs))
  width = -(-max_seq_len // page_size) * page_size
  kvb = _nbytes(kv_dtype or cfg.dtype)
  # The attention runs where the pool's KV heads live; pages split over data are gathered whole.
  hkv = cfg.num_kv_heads / (_kv_split(cfg, sizes) if kv_pool != "replicated" else 1)
  seqs = ng + num_slots
  gathered = seqs * width * hkv * cfg.head_dim * (kvb + F32)
  heads = cfg.num_heads / (_heads_split(cfg.num_heads, sizes["tensor"])
                           if kv_pool != "replicated" else 1)
  scores = (ng * gs + num_slots) * heads * width * F32 * 2  # logits and exp
  logits = 4 * num_slots * cfg.vocab_size * F32
  batch = num_slots * (4 * 6 + 8 + 4 + 4 + 1) + 4 * (ng * (width // page_size + 1 + gs) +
                                                      num_slots * (width // page_size + 1))
  terms = {"params (policy, param_dtype)": params, "KV pool": pool, "batch and tables": batch,
           "step temporaries: max(attention of one layer, logits)": max(gathered + scores, logits)}
  return StepPlan(terms, argument=params + pool + batch, output=pool, alias=pool)


# ---- a whole training process -----------------------------------------------------------------
def _sizes(mesh_spec) -> dict:
  sizes = parse_mesh_spec(mesh_spec)
  if any(s < 1 for s in sizes.values()):
    raise ValueError(f"plan needs explicit mesh sizes, got {sizes}")
  return sizes


@dataclasses.dataclass
class MemoryPlan:
  """Per-device GB of a training process: what stays allocated plus its largest step."""
  mesh: dict
  n_params: int
  replicated_fallbacks: int
  resident: dict         # name -> GB, alive through the whole loop
  update_extra: dict     # name -> GB, alive only inside the update step
  decode_extra: dict     # name -> GB, alive only inside a decode step
  error: str = ""        # a reason the config cannot run on this mesh at all

  @property
  def resident_gb(self) -> float:
    return sum(self.resident.values())

  @property
  def update_gb(self) -> float:
    return self.resident_gb + sum(self.update_extra.values())

  @property
  def decode_gb(self) -> float:
    return self.resident_gb + sum(self.decode_extra.values())

  @property
  def total_gb(self) -> float:
    return max(self.update_gb, self.decode_gb)

  # Older names, kept for callers of the first plan.
  @property
  def params_gb(self) -> float:
    return self.resident.get("policy weights (sampler)", 0.0)

  @property
  def optimizer_gb(self) -> float:
    return self.resident.get("AdamW mu + nu", 0.0)

  @property
  def kv_pool_gb(self) -> float:
    return self.resident.get("KV pool", 0.0)


def plan_memory(cfg: DecoderConfig, mesh_spec, *, num_pages: int, page_size: int, seq_len: int,
                rows: int | None = None, micro_batches: int = 1,
                micro_batch_seqs: int | None = None, num_slots: int = 256, remat: str = "none",
                kl_coef: float = 0.0, kv_pool: str = "main", master_dtype="float32",
                preds_per_row: int = 18, predictor_hidden: int = 256, packing: str = "none",
                update_seq_len: int | None = None, lora_rank: int = 0, lora_targets: str = "all",
                lora_sampler: str = "merged", rules=DEFAULT_RULES) -> MemoryPlan:
  """Per-device memory of one process running the RL loop of `train.py` on a (data, fsdp,
  tensor) mesh: resident weights, optimizer state and KV pool, plus the larger of the update
  step's and the decode step's own temporaries.

  rows: the update batch's packed rows (all devices), split into `micro_batches`;
  `micro_batch_seqs` (the first plan's argument) stands for rows=micro_batch_seqs, one micro-batch.
  update_seq_len: the update rows' length when it differs from `seq_len` (tree packing with
  `rl.pack_row_len`). lora_rank > 0 (`trace_jax.lora_run`): one frozen base in param_dtype (also
  the KL reference), f32 adapters and moments, and the sampler's merged copy
  (`lora_sampler="merged"`) or none (`"unmerged"`, on a mesh without fsdp, where the engine's
  sampling layout is the base's own).
  """
  if rows is None:
    if micro_batch_seqs is None:
      raise ValueError("plan_memory needs rows (and micro_batches) or micro_batch_seqs")
    rows, micro_batches = micro_batch_seqs, 1
  sizes = _sizes(mesh_spec)
  lay = param_layout(cfg, sizes, rules)
  mb = _nbytes(master_dtype_of(cfg.param_dtype, master_dtype))
  pb = _nbytes(cfg.param_dtype)
  per = lay.per_device
  resident = {
      "masters": per * mb / GB,
      "AdamW mu + nu": 2 * per * mb / GB,
      "policy weights (sampler)": per * pb / GB,
      "init params (Run.init_params)": per * pb / GB if mb != pb else 0.0,
      "KL reference": per * pb / GB if kl_coef > 0 else 0.0,
      "KV pool": kv_pool_bytes(cfg, sizes, num_pages=num_pages, page_size=page_size,
                               kv_pool=kv_pool) / GB,
  }
  if lora_rank > 0:
    ad = lora_layout(cfg, sizes, lora_rank, lora_targets, rules) * F32
    copy = lora_sampler == "merged" or sizes["fsdp"] > 1
    resident.update({
        "masters": 0.0, "frozen base (param_dtype)": per * pb / GB,
        "adapters (f32)": ad / GB, "AdamW mu + nu": 2 * ad / GB,
        "policy weights (sampler)": per * pb / GB if copy else 0.0,
        "init params (Run.init_params)": ad / GB, "KL reference": 0.0})
  error, update_extra = "", {}
  try:
    up = plan_update_step(cfg, sizes, rows=rows, seq_len=update_seq_len or seq_len,
                          micro_batches=micro_batches,
                          remat=remat, preds_per_row=preds_per_row, master_dtype=master_dtype,
                          predictor_hidden=predictor_hidden, packing=packing,
                          lora_rank=lora_rank, lora_targets=lora_targets, rules=rules)
    skip = ("state (masters + AdamW mu, nu)", "frozen base (param_dtype)")
    update_extra = {k: v / GB for k, v in up.terms.items() if k not in skip}
  except ValueError as e:
    error = str(e)
  dec = plan_decode_step(cfg, sizes, num_slots=num_slots, num_pages=num_pages,
                         page_size=page_size, max_seq_len=seq_len, kv_pool=kv_pool,
                         rules=rules)
  decode_extra = {k: v / GB for k, v in dec.terms.items()
                  if k not in ("params (policy, param_dtype)", "KV pool")}
  return MemoryPlan(mesh=sizes, n_params=lay.n_params,
                    replicated_fallbacks=lay.replicated_fallbacks,
                    resident=resident, update_extra=update_extra, decode_extra=decode_extra,
                    error=error)


# ---- devices, meshes, the table ----------------------------------------------------------------
# name -> (GB of memory per device); the per-device figure a plan must stay under.
DEVICES = (("v5e", 16), ("v4", 32), ("v5p", 95), ("H200", 141))
DEVICE_GB = tuple(g for _, g in DEVICES)
# Slices named by TensorCores: v5p-64 is 32 chips of 95 GB, v5e-256 is 256 chips of 16 GB.
SLICES = {"v5p-64": (32, 95), "v5e-256": (256, 16)}


def candidate_meshes(n_devices: int, num_kv_heads: int = 8) -> list[str]:
  """(data, fsdp, tensor) splits of n_devices with tensor dividing the KV heads, tensor >= 4."""
  out = []
  for t in (4, 8):
    if n_devices % t or num_kv_heads % t:
      continue
    rest = n_devices // t
    f = 1
    while f <= rest:
      if rest % f == 0:
        out.append(f"data:{rest // f},fsdp:{f},tensor:{t}")
      f *= 2
  return out


CANDIDATE_MESHES = ("data:1,fsdp:1,tensor:8", "data:4,fsdp:1,tensor:8", "data:1,fsdp:4,tensor:8",
                    "data:2,fsdp:2,tensor:8", "data:1,fsdp:8,tensor:4",
                    "data:32,fsdp:1,tensor:8", "data:1,fsdp:32,tensor:8",
                    "data:4,fsdp:8,tensor:8", "data:2,fsdp:16,tensor:8")


def format_table(plans: list[MemoryPlan], device_gb=DEVICE_GB, headroom: float = 0.9) -> str:
  head = (f"{'mesh (d,f,t)':<14}{'dev':>5}{'weights':>9}{'optim':>8}{'kv pool':>9}"
          f"{'update+':>9}{'decode+':>9}{'peak GB':>9}  " +
          "  ".join(f"{g}GB" for g in device_gb))
  rows = [head, "-" * len(head)]
  for p in plans:
    m = p.mesh
    ndev = m["data"] * m["fsdp"] * m["tensor"]
    w = sum(v for k, v in p.resident.items() if k not in ("AdamW mu + nu", "KV pool"))
    if p.error:
      fits = "  ".join(f"{'--':>{len(str(g)) + 2}}" for g in device_gb)
      rows.append(f"{(m['data'], m['fsdp'], m['tensor'])!s:<14}{ndev:>5}{w:>9.2f}"
                  f"{p.optimizer_gb:>8.2f}{p.kv_pool_gb:>9.2f}{'n/a':>9}"
                  f"{sum(p.decode_extra.values()):>9.2f}{'n/a':>9}  {fits}")
      continue
    fits = "  ".join(f"{'yes' if p.total_gb <= g * headroom else 'no':>{len(str(g)) + 2}}"
                     for g in device_gb)
    rows.append(f"{(m['data'], m['fsdp'], m['tensor'])!s:<14}{ndev:>5}{w:>9.2f}"
                f"{p.optimizer_gb:>8.2f}{p.kv_pool_gb:>9.2f}{sum(p.update_extra.values()):>9.2f}"
                f"{sum(p.decode_extra.values()):>9.2f}{p.total_gb:>9.2f}  {fits}")
  return "\n".join(rows)
