"""HF checkpoint import and export shared by the model families: config.json reading, the HF
tensor names of our parameters, lazy safetensors loading and sharded export.

Each HF tensor maps to one of our parameters through a layout transform (HF stores linear layers as
[out, in]; we keep attention projections as [embed, heads, head_dim]). With a mesh, every parameter
is built by `jax.make_array_from_callback`, so each device reads only its own slice of the
memory-mapped file and a large model is never materialized whole on one device. A family's
`from_pretrained` / `save_pretrained` / `load_config` are these functions given its config and
model classes (`models.qwen3.params`; `trace_jax.models` dispatches on `model_type`).
"""

from __future__ import annotations

import json
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax.fileio import atomic_write_json
from trace_jax.models.decoder import Decoder
from trace_jax.models.decoder_config import DecoderConfig, dtype_name, resolve_dtype
from trace_jax.models.safetensors_io import SafetensorsFile, save_file
from trace_jax.parallel.sharding import (DEFAULT_RULES, set_variable_value, state_shardings,
                                         variable_value)

Transform = Callable[[np.ndarray], np.ndarray]


def param_mapping(cfg: DecoderConfig) -> dict[tuple, tuple[str, Transform, Transform]]:
  """our param path -> (HF key, hf_to_ours, ours_to_hf), for every family: they share HF's
  tensor names (`model.layers.{i}.self_attn.q_proj.weight`, ...) and differ only in which exist."""
  d, h, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  ident = (lambda a: a, lambda a: a)
  tr = (lambda a: a.T, lambda a: a.T)

  def proj_in(n):  # HF [n*hd, d] <-> ours [d, n, hd]
    return (lambda a: a.T.reshape(d, n, hd), lambda a: a.reshape(d, n * hd).T)

  def bias(n):
    return (lambda a: a.reshape(n, hd), lambda a: a.reshape(n * hd))

  o_proj = (lambda a: a.T.reshape(h, hd, d), lambda a: a.reshape(h * hd, d).T)
  m = {("embed_tokens",): ("model.embed_tokens.weight", *ident),
       ("norm", "weight"): ("model.norm.weight", *ident)}
  if not cfg.tie_word_embeddings:
    m[("lm_head",)] = ("lm_head.weight", *tr)
  for i in range(cfg.num_layers):
    p, k = ("layers", i), f"model.layers.{i}."
    m[p + ("input_layernorm", "weight")] = (k + "input_layernorm.weight", *ident)
    m[p + ("post_attention_layernorm", "weight")] = (k + "post_attention_layernorm.weight", *ident)
    m[p + ("self_attn", "q_proj")] = (k + "self_attn.q_proj.weight", *proj_in(h))
    m[p + ("self_attn", "k_proj")] = (k + "self_attn.k_proj.weight", *proj_in(kv))
    m[p + ("self_attn", "v_proj")] = (k + "self_attn.v_proj.weight", *proj_in(kv))
    m[p + ("self_attn", "o_proj")] = (k + "self_attn.o_proj.weight", *o_proj)
    if cfg.qk_norm:
      m[p + ("self_attn", "q_norm", "weight")] = (k + "self_attn.q_norm.weight", *ident)
      m[p + ("self_attn", "k_norm", "weight")] = (k + "self_attn.k_norm.weight", *ident)
    if cfg.attention_bias:
      for name, n in (("q", h), ("k", kv), ("v", kv)):
        m[p + ("self_attn", f"{name}_bias")] = (k + f"self_attn.{name}_proj.bias", *bias(n))
    m[p + ("mlp", "gate_proj")] = (k + "mlp.gate_proj.weight", *tr)
    m[p + ("mlp", "up_proj")] = (k + "mlp.up_proj.weight", *tr)
    m[p + ("mlp", "down_proj")] = (k + "mlp.down_proj.weight", *tr)
  return m


def read_config_json(path: str) -> dict:
  """The `config.json` dict of checkpoint directory `path` (clear errors when absent or
  malformed)."""
  if not os.path.isdir(path):
    raise FileNotFoundError(f"checkpoint directory not found: {path!r}")
  cfg_path = os.path.join(path, "config.json")
  if not os.path.isfile(cfg_path):
    raise FileNotFoundError(f"no config.json in checkpoint directory {path!r}")
  try:
    with open(cfg_path) as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{cfg_path}: malformed JSON: {e}") from None


def load_config(path: str, config_cls: type[DecoderConfig], **overrides) -> DecoderConfig:
  """`config_cls.from_hf_dict` of the checkpoint's `config.json`, errors prefixed by its path."""
  d = read_config_json(path)
  try:
    return config_cls.from_hf_dict(d, **overrides)
  except (KeyError, ValueError) as e:
    raise type(e)(f"{os.path.join(path, 'config.json')}: {e}") from None


class TensorIndex:
  """Finds each HF tensor in a single or sharded safetensors checkpoint."""

  def __init__(self, path: str):
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    self.files: dict[str, SafetensorsFile] = {}
    self.where: dict[str, str] = {}
    if os.path.isfile(index):
      try:
        with open(index) as f:
          weight_map = json.load(f)["weight_map"]
      except (json.JSONDecodeError, KeyError) as e:
        raise ValueError(f"{index}: malformed index ({e!r})") from None
      for key, fname in weight_map.items():
        self.where[key] = os.path.join(path, fname)
    elif os.path.isfile(single):
      for key in self._open(single).keys():
        self.where[key] = single
    else:
      raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path!r}")

  def _open(self, fname):
    if fname not in self.files:
      self.files[fname] = SafetensorsFile(fname)
    return self.files[fname]

  def __contains__(self, key):
    return key in self.where

  def get(self, key) -> np.ndarray:
    if key not in self.where:
      raise KeyError(f"tensor {key!r} is missing from the checkpoint")
    f = self._open(self.where[key])
    if key not in f:
      raise KeyError(f"{f.path}: the index names tensor {key!r} but the file lacks it")
    return f[key]


def load_pretrained(path: str, config_cls: type[DecoderConfig], model_cls: type[Decoder],
                    dtype=None, param_dtype=None, mesh=None, rules=DEFAULT_RULES,
                    **config_overrides) -> Decoder:
  """Loads an HF checkpoint directory (config.json + safetensors) into `model_cls`.

  dtype: compute dtype; param_dtype: storage dtype (default: `dtype`, else float32). With `mesh`,
  each parameter is placed directly in its logical sharding. Tensors are read lazily from
  `model.safetensors` or the shards of `model.safetensors.index.json`; `config_overrides` replace
  fields of the config read from `config.json`.
  """
  dtype = resolve_dtype(dtype) if dtype is not None else jnp.float32
  param_dtype = resolve_dtype(param_dtype) if param_dtype is not None else dtype
  cfg = load_config(path, config_cls, dtype=dtype, param_dtype=param_dtype, **config_overrides)
  tensors = TensorIndex(path)
  abstract = nnx.eval_shape(lambda: model_cls(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  shardings = state_shardings(state, mesh, rules) if mesh is not None else None
  mapping = param_mapping(cfg)
  flat = nnx.to_flat_state(state)
  shard_flat = dict(nnx.to_flat_state(shardings)) if shardings is not None else {}
  values = {}
  for p, var in flat:
    if p not in mapping:
      raise KeyError(f"no HF tensor is mapped to parameter {p}")
    key, to_ours, _ = mapping[p]
    src = tensors.get(key)
    view = to_ours(src)
    want = variable_value(var).shape
    if tuple(view.shape) != tuple(want):
      raise ValueError(f"{path}: tensor {key!r} has shape {src.shape}, which does not match the "
                       f"config (expected {want} after layout transform)")
    np_dtype = np.dtype(param_dtype)
    if p in shard_flat:
      sh = shard_flat[p]
      sh = variable_value(sh) if isinstance(sh, nnx.Variable) else sh
      values[p] = jax.make_array_from_callback(
          want, sh, lambda idx, v=view: np.asarray(v[idx]).astype(np_dtype))
    else:
      values[p] = jnp.asarray(np.asarray(view).astype(np_dtype))
  for p, var in flat:
    set_variable_value(var, values[p])
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def save_pretrained(model: Decoder, path: str, max_shard_bytes: int = 5 * 2**30,
                    dtype=None) -> None:
  """Writes `config.json` (the model's family, from its config) and HF-layout safetensors (sharded
  with an index past max_shard_bytes); `dtype` casts the stored tensors (e.g. "bfloat16");
  default: as the parameters are. The directory loads with `from_pretrained` and `transformers`.

  Example:
    >>> model = Qwen3(get_preset("tiny", num_layers=1), rngs=nnx.Rngs(0))
    >>> save_pretrained(model, path := tempfile.mkdtemp())
    >>> sorted(os.listdir(path))
    ['config.json', 'model.safetensors']
  """
  cfg = model.cfg
  os.makedirs(path, exist_ok=True)
  mapping = param_mapping(cfg)
  out = {}
  for p, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    key, _, to_hf = mapping[p]
    a = np.asarray(jax.device_get(var[...]))
    if dtype is not None:
      a = a.astype(np.dtype(resolve_dtype(dtype)))
    out[key] = np.ascontiguousarray(to_hf(a))
  shards, cur, size = [], {}, 0
  for k in sorted(out):
    if cur and size + out[k].nbytes > max_shard_bytes:
      shards.append(cur)
      cur, size = {}, 0
    cur[k] = out[k]
    size += out[k].nbytes
  shards.append(cur)
  if len(shards) == 1:
    save_file(shards[0], os.path.join(path, "model.safetensors"))
  else:
    weight_map = {}
    for i, shard in enumerate(shards):
      fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      save_file(shard, os.path.join(path, fname))
      weight_map.update({k: fname for k in shard})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
      json.dump({"metadata": {"total_size": sum(a.nbytes for a in out.values())},
                 "weight_map": weight_map}, f, indent=1)
  hf = cfg.to_hf_dict()
  if dtype is not None:
    hf["torch_dtype"] = dtype_name(dtype)
  # Atomic (and after the weights): a reader never finds a torn config.json.
  atomic_write_json(os.path.join(path, "config.json"), hf, indent=1)
