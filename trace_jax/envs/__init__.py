"""Environments: ReAct protocol, scoring, retrieval, the multi-hop env and the synthetic world."""

from trace_jax.envs.env import EnvState, MultiHopEnv, StepResult, segments_to_tokens
from trace_jax.envs.react import (
    STOP_STRINGS, Action, format_observation, parse_action, truncate_observation,
)
from trace_jax.envs.retrieval import BM25Retriever, load_corpus_jsonl
from trace_jax.envs.scoring import (
    em_format_reward, em_reward, exact_match, f1, f1_reward, get_reward_fn, normalize_answer,
)
from trace_jax.envs.types import Doc, Retriever

__all__ = [
    "STOP_STRINGS", "Action", "BM25Retriever", "Doc", "EnvState", "MultiHopEnv", "Retriever",
    "StepResult", "em_format_reward", "em_reward", "exact_match", "f1", "f1_reward",
    "format_observation", "get_reward_fn", "load_corpus_jsonl", "normalize_answer",
    "parse_action", "segments_to_tokens", "truncate_observation",
]
