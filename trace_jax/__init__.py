"""trace_jax: Tree Rollout Allocation for Contrastive Exploration, in JAX.

The names below are the pieces meant for reuse outside the trainer (README, "Use in your own
project"). They are imported lazily, on first access, so `import trace_jax` stays cheap: it imports
neither jax nor flax until a name is used.

  allocation:  allocate_roots, allocate_roots_subset, allocate_prefixes,
               allocate_prefixes_tree_aware, root_value
  advantages:  backup_values, tree_contrastive_advantages, grpo_advantages, tree_grpo_advantages,
               treerl_advantages, ownership_mask, token_advantages
  losses:      ppo_clip_loss, token_logprobs_and_entropy
  attention:   tree_attention, tree_attention_reference
  model:       Qwen3, Qwen3Config, get_preset, init_cache, from_pretrained, save_pretrained,
               PredictorHead
  sampling:    SamplerEngine, SamplerConfig, PromptRequest, ForkRequest
  scoring:     exact_match, f1, normalize_answer
  data:        load_qa
"""

import importlib

__version__ = "0.1.0"

# Public name -> module that defines it.
_EXPORTS = {
    "allocate_roots": "trace_jax.allocation.allocators",
    "allocate_roots_subset": "trace_jax.allocation.allocators",
    "allocate_prefixes": "trace_jax.allocation.allocators",
    "allocate_prefixes_tree_aware": "trace_jax.allocation.allocators",
    "root_value": "trace_jax.allocation.allocators",
    "backup_values": "trace_jax.rl.advantages",
    "tree_contrastive_advantages": "trace_jax.rl.advantages",
    "grpo_advantages": "trace_jax.rl.advantages",
    "tree_grpo_advantages": "trace_jax.rl.advantages",
    "treerl_advantages": "trace_jax.rl.advantages",
    "ownership_mask": "trace_jax.rl.advantages",
    "token_advantages": "trace_jax.rl.advantages",
    "ppo_clip_loss": "trace_jax.rl.losses",
    "token_logprobs_and_entropy": "trace_jax.rl.losses",
    "tree_attention": "trace_jax.kernels.dispatch",
    "tree_attention_reference": "trace_jax.kernels.reference",
    "Qwen3": "trace_jax.models.qwen3.model",
    "Qwen3Config": "trace_jax.models.qwen3.config",
    "get_preset": "trace_jax.models.qwen3.config",
    "init_cache": "trace_jax.models.qwen3.model",
    "from_pretrained": "trace_jax.models.registry",
    "save_pretrained": "trace_jax.models.registry",
    "PredictorHead": "trace_jax.models.predictor",
    "SamplerEngine": "trace_jax.sampling.engine",
    "SamplerConfig": "trace_jax.sampling.config",
    "PromptRequest": "trace_jax.sampling.config",
    "ForkRequest": "trace_jax.sampling.config",
    "ToolEnv": "trace_jax.envs.interface",
    "FunctionEnv": "trace_jax.envs.interface",
    "TreeEnvAdapter": "trace_jax.envs.adapter",
    "exact_match": "trace_jax.envs.scoring",
    "f1": "trace_jax.envs.scoring",
    "normalize_answer": "trace_jax.envs.scoring",
    "load_qa": "trace_jax.data.formats",
}
__all__ = sorted(_EXPORTS)  # noqa: PLE0605


def __getattr__(name):
  if name not in _EXPORTS:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  value = getattr(importlib.import_module(_EXPORTS[name]), name)
  globals()[name] = value  # later accesses skip __getattr__
  return value


def __dir__():
  return sorted(set(globals()) | set(_EXPORTS))
