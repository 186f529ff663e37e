"""LoRA adapters on the decoder's projections: a frozen base plus W + (alpha / r) A @ B.

`attach(model, rank, alpha, targets, rngs)` gives each targeted projection of every layer an
adapter (`LoRAAdapter`, the module attribute `<weight>_lora`, e.g. `self_attn.q_proj_lora`) whose
A and B are `nnx.LoRAParam`s in f32, B zero, so a freshly adapted model computes exactly what its
base computes. The decoder adds `adapter.delta(x)` to a projection's output when the adapter is
there (unmerged: the update's forward never forms W + s A B, and its backward never forms a dense
weight gradient). `split(model)` separates the base (storage dtype, frozen) from the adapters (the
trained parameters); `merged_weights` folds the adapters into the base's weights, in the base
graph's structure, for the sampler and for HF export (`save_pretrained`).

Shapes: a projection W of input dims I (contracted) and output dims O (q: I = (embed,),
O = (heads, head_dim); o: I = (heads, head_dim), O = (embed,)) gets A f32[*I, r] and B f32[r, *O],
with the base's logical axes on I and O and `lora_rank` (replicated) on r, so adapters are sharded
as their base is.

`fingerprint(state)` names a base's weights exactly (integer checksums of their bits, the same on
any mesh): a LoRA checkpoint records it, and a resume onto another base is refused.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math

import jax
import jax.numpy as jnp
from flax import nnx

# target name -> (the layer's submodule, the weight's attribute, number of input dims)
TARGETS = {
    "q": ("self_attn", "q_proj", 1),
    "k": ("self_attn", "k_proj", 1),
    "v": ("self_attn", "v_proj", 1),
    "o": ("self_attn", "o_proj", 2),
    "gate": ("mlp", "gate_proj", 1),
    "up": ("mlp", "up_proj", 1),
    "down": ("mlp", "down_proj", 1),
}
SUFFIX = "_lora"


def parse_targets(targets: str | tuple | list) -> tuple[str, ...]:
  """"q,k,v,o" (or a sequence) -> ("q", "k", "v", "o"); "all" -> every target. Raises ValueError
  naming an unknown target."""
  if isinstance(targets, str):
    targets = tuple(TARGETS) if targets.strip() == "all" else targets.split(",")
  out = tuple(t.strip() for t in targets if t.strip())
  bad = [t for t in out if t not in TARGETS]
  if bad or not out:
    raise ValueError(f"LoRA targets {bad or '(none)'} unknown; choose among {sorted(TARGETS)} "
                     f"(comma-separated) or 'all'")
  return tuple(dict.fromkeys(out))


class LoRAAdapter(nnx.Module):
  """y += (alpha / r) (x A) B on a projection of input shape I and output shape O.

  A f32[*I, r] is drawn as PEFT draws it (uniform, bound 1 / sqrt(prod I)); B f32[r, *O] is zero.
  """

  def __init__(self, in_shape, out_shape, in_axes, out_axes, rank: int, alpha: float, *,
               rngs: nnx.Rngs):
    bound = 1.0 / math.sqrt(math.prod(in_shape))
    self.a = nnx.LoRAParam(jax.random.uniform(rngs.params(), (*in_shape, rank), jnp.float32,
                                              -bound, bound),
                           logical_axes=(*in_axes, "lora_rank"))
    self.b = nnx.LoRAParam(jnp.zeros((rank, *out_shape), jnp.float32),
                           logical_axes=("lora_rank", *out_axes))
    self.n_in = len(in_shape)
    self.scale = float(alpha) / rank

  def delta(self, x, dtype):
    """x: [..., *I] -> (alpha / r) (x A) B: [..., *O] in `dtype` (the compute dtype)."""
    xa = jnp.tensordot(x, self.a[...].astype(dtype), axes=self.n_in)
    return jnp.tensordot(xa, self.b[...].astype(dtype), axes=1) * jnp.asarray(self.scale, dtype)

  def dense(self):
    """(alpha / r) A B: f32[*I, *O], the weight update this adapter stands for."""
    return jnp.tensordot(self.a[...], self.b[...], axes=1) * self.scale


def delta(module, weight: str, x, y):
  """`y` plus the adapter of `module.<weight>` applied to `x`, or `y` as it is without one."""
  adapter = getattr(module, weight + SUFFIX, None)
  return y if adapter is None else y + adapter.delta(x, y.dtype)


def _targeted(model, targets):
  for layer in model.layers:
    for t in targets:
      sub, weight, n_in = TARGETS[t]
      yield getattr(layer, sub), weight, n_in


def attach(model, rank: int, alpha: float, targets, rngs: nnx.Rngs):
  """Gives every layer's targeted projections a zero-B adapter (in place); returns `model`."""
  if rank < 1:
    raise ValueError(f"LoRA rank must be >= 1, got {rank}")
  for module, weight, n_in in _targeted(model, parse_targets(targets)):
    w = getattr(module, weight)
    axes = tuple(w.logical_axes)
    shape = tuple(w[...].shape)
    setattr(module, weight + SUFFIX,
            LoRAAdapter(shape[:n_in], shape[n_in:], axes[:n_in], axes[n_in:], rank, alpha,
                        rngs=rngs))
  return model


def split(model):
  """(graphdef with adapters, base nnx.State, adapters nnx.State): `nnx.merge(graphdef, base,
  adapters)` is the adapted model; the base's paths are those of the model without adapters."""
  graphdef, adapters, base = nnx.split(model, nnx.LoRAParam, ...)
  return graphdef, base, adapters


def adapt(graphdef, params, rank: int, alpha: float, targets, seed: int):
  """A base (`graphdef`, `params`: a model without adapters) given fresh adapters: returns
  (graphdef with adapters, base state, adapter state); the base's arrays are not copied."""
  model = nnx.merge(graphdef, params)
  attach(model, rank, alpha, targets, nnx.Rngs(seed))
  return split(model)


def _is_var(x):
  return isinstance(x, nnx.Variable)


def _merge(graphdef, base, adapters):
  model = nnx.merge(graphdef, base, adapters)
  dense = {}
  for path, var in nnx.to_flat_state(adapters):
    if path[-1] == "a":
      owner = path[-2][:-len(SUFFIX)]
      adapter = model
      for k in path[:-1]:
        adapter = adapter[k] if isinstance(k, int) else getattr(adapter, k)
      dense[(*path[:-2], owner)] = adapter.dense()

  def fold(path, v):
    key = tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", None))) for k in path)
    d = dense.get(key)
    if d is None:
      return v
    w = v[...]
    return v.replace((w.astype(jnp.float32) + d).astype(w.dtype))
  return jax.tree_util.tree_map_with_path(fold, base, is_leaf=_is_var)


@functools.lru_cache(maxsize=8)
def _merge_fn(graphdef):
  return jax.jit(functools.partial(_merge, graphdef))


def merged_weights(graphdef, base, adapters):
  """The base's weights with every adapter folded in, W + (alpha / r) A B rounded to W's dtype,
  in the structure (and sharding) of `base`: the weights of the plain model (jitted; a new copy)."""
  return _merge_fn(graphdef)(base, adapters)


def combined(base, adapters):
  """One state holding base and adapters (for an engine built on the adapted graph: unmerged)."""
  return nnx.merge_state(base, adapters)


def _bits(x):
  x = jnp.asarray(x)
  u = x.view(jnp.dtype(f"uint{x.dtype.itemsize * 8}")) if x.dtype.itemsize in (1, 2, 4) else x
  return u.astype(jnp.uint32)


@jax.jit
def _checksums(leaves):
  out = []
  for x in leaves:
    b = _bits(x)
    idx = jnp.arange(b.size, dtype=jnp.uint32).reshape(b.shape)
    # Integer sums wrap and are exact in any order: the same on every mesh and device.
    out.append(jnp.stack([jnp.sum(b * (idx * jnp.uint32(2654435761) + jnp.uint32(1))),
                          jnp.sum(b ^ (idx * jnp.uint32(40503)))]))
  return out


def fingerprint(state) -> str:
  """A short hex name of a weight state's exact contents (paths, shapes, dtypes, bits)."""
  flat = list(nnx.to_flat_state(state))
  sums = jax.device_get(_checksums([v[...] for _, v in flat]))
  desc = [["/".join(map(str, p)), list(v[...].shape), str(v[...].dtype),
           [int(s) for s in c]] for (p, v), c in zip(flat, sums)]
  return hashlib.sha256(json.dumps(desc).encode()).hexdigest()[:16]


def strip(model):
  """Removes every adapter of `model` (in place); returns it."""
  for layer in model.layers:
    for sub, weight, _ in TARGETS.values():
      module = getattr(layer, sub)
      if hasattr(module, weight + SUFFIX):
        delattr(module, weight + SUFFIX)
  return model


def plain_graphdef(graphdef, base, adapters):
  """The graph of the model without adapters (the structure `merged_weights` returns)."""
  return nnx.split(strip(nnx.merge(graphdef, base, adapters)))[0]


def merged_model(graphdef, base, adapters):
  """The plain model (no adapters) with the merged weights: `save_pretrained(merged_model(...),
  path)` exports a LoRA policy as an HF checkpoint that any reader of the family loads."""
  return nnx.merge(plain_graphdef(graphdef, base, adapters),
                   merged_weights(graphdef, base, adapters))
