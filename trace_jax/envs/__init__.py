"""Environments, grouped by role: the interface a tool task implements (`interface.ToolEnv`), its
sampler adapter and checks, the ReAct protocol, prompts and scoring (this folder); `retrieval/`
(BM25, the HTTP client and server); `tasks/` (multi-hop QA, math, function calling);
`worlds/` (the synthetic multi-hop worlds).

Names are imported lazily, so `import trace_jax.envs.react` (or the HTTP retriever) does not pull
in bm25s, numpy or tokenizers.
"""

import importlib

_EXPORTS = {
    "EnvState": "tasks.multihop", "MultiHopEnv": "tasks.multihop",
    "segments_to_tokens": "tasks.multihop",
    "FunctionEnv": "interface", "StepResult": "interface", "ToolEnv": "interface",
    "check_env": "interface", "TreeEnvAdapter": "adapter",
    "build_search_r1_prompt": "prompts", "synthetic_prompt": "prompts",
    "STOP_STRINGS": "react", "Action": "react", "format_observation": "react",
    "parse_action": "react", "truncate_observation": "react",
    "BM25Retriever": "retrieval.bm25", "load_corpus_jsonl": "retrieval.bm25",
    "em_format_reward": "scoring", "em_reward": "scoring", "exact_match": "scoring",
    "f1": "scoring", "f1_reward": "scoring", "get_reward_fn": "scoring",
    "normalize_answer": "scoring",
    "Doc": "types", "Retriever": "types",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name not in _EXPORTS:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
  globals()[name] = value
  return value


def __dir__():
  return sorted(set(globals()) | set(_EXPORTS))
