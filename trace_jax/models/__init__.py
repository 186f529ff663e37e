"""Model families and the interface the rest of trace_jax uses them through.

`from_pretrained(path, dtype=...)` reads a checkpoint directory's `config.json`, picks the family
its `model_type` names (qwen3, qwen2 for Qwen2/Qwen2.5, llama for Llama 3.x) and returns that
family's model: `model(tokens i32[B, T]) -> logits f32[B, T, V]`. `load_config`, `save_pretrained`
and `get_preset` dispatch alike (`models.registry`).

What a family provides (today every family is the shared `decoder.Decoder` with its own config
class; a family that needs other layers subclasses it and keeps these calls):
- a config class, a frozen dataclass subclassing `decoder_config.DecoderConfig`: `MODEL_TYPE`,
  `from_hf_dict` / `to_hf_dict` (HF `config.json`), `replace`, and the fields the sampler, the
  update and the memory plan read (`vocab_size`, `hidden_size`, `intermediate_size`, `num_layers`,
  `num_heads`, `num_kv_heads`, `head_dim`, `dtype`, `param_dtype`); named presets (`PRESETS`,
  `get_preset`), real sizes included, for the memory plan.
- a model class, an nnx module built as `Model(cfg, *, rngs=...)` with `.cfg`, used functionally
  (`nnx.split` outside jit, `nnx.merge` inside), whose parameters are `nnx.Param`s carrying
  `logical_axes` among vocab, embed, heads, kv_heads, head_dim, mlp, norm (the sharding rules of
  `parallel.sharding` map them to mesh axes), and these calls:
  - `run_layers(tokens, positions, attend, collect_hidden=False, remat="none")` -> (hidden after
    the final norm [B, T, D], per-layer hidden states or None, per-layer `aux`): the layers with a
    caller's attention `attend(layer, q [B, T, H, hd], k, v [B, T, Hkv, hd]) -> (o, aux)`, q and k
    already rotated. The sampler's paged decode and chunked prefill write and read KV pages in
    `attend` (so the sampler imports no family);
  - `logits(hidden [..., D]) -> f32[..., V]`;
  - `forward(tokens, positions, cache, attn_mask, segment_ids, collect_hidden, compute_logits,
    remat, kv_end, kv_blocks) -> dict(logits, hidden, cache, hidden_states)`: without a cache,
    the forward over packed rows the update runs (segments, or packed trees through `kv_end`,
    block-sparse with `kv_blocks`, `models.blocked_attention`); `hidden` is the
    final state the predictor reads; with a cache (`init_cache`), contiguous decoding;
  - `__call__(tokens, positions=None, cache=None, attn_mask=None, segment_ids=None)`.
  The padding, segment, `kv_end` and cache contract is `decoder`'s module docstring.
- HF import and export: `load_config`, `from_pretrained`, `save_pretrained` (`hf_checkpoint`:
  lazy per-shard safetensors reads, sharded placement, sharded export), and a `Family` entry in
  `registry.FAMILIES`.

LoRA (`models.lora`) works on any family built on the shared decoder: adapters attach to the
layers' `self_attn.{q,k,v,o}_proj` and `mlp.{gate,up,down}_proj`, whose outputs the decoder adds.
"""

import importlib

# Public name -> module that defines it (imported on first use, so `trace_jax.models.attention`
# and the sampler that imports it load no family).
_EXPORTS = {
    "Decoder": "trace_jax.models.decoder",
    "DecoderConfig": "trace_jax.models.decoder_config",
    "init_cache": "trace_jax.models.decoder",
    "FAMILIES": "trace_jax.models.registry",
    "Family": "trace_jax.models.registry",
    "build_model": "trace_jax.models.registry",
    "checkpoint_family": "trace_jax.models.registry",
    "family": "trace_jax.models.registry",
    "family_of": "trace_jax.models.registry",
    "from_pretrained": "trace_jax.models.registry",
    "get_preset": "trace_jax.models.registry",
    "load_config": "trace_jax.models.registry",
    "save_pretrained": "trace_jax.models.registry",
    "Qwen3": "trace_jax.models.qwen3",
    "Qwen3Config": "trace_jax.models.qwen3",
    "Qwen2": "trace_jax.models.qwen2",
    "Qwen2Config": "trace_jax.models.qwen2",
    "Llama": "trace_jax.models.llama",
    "LlamaConfig": "trace_jax.models.llama",
}
__all__ = sorted(_EXPORTS)  # noqa: PLE0605


def __getattr__(name):
  if name not in _EXPORTS:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  value = getattr(importlib.import_module(_EXPORTS[name]), name)
  globals()[name] = value  # later accesses skip __getattr__
  return value
