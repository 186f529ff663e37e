"""Attention kernels: tree (cascade) decode attention over a paged KV pool.

`trace_jax.kernels.tree_attention` here is the dispatching function; the module of the same name
is reached with `from trace_jax.kernels.tree_attention import ...` or importlib.
"""

from trace_jax.kernels.tree_attention import IMPL_ENV_VAR
from trace_jax.kernels.tree_attention import MASK_VALUE
from trace_jax.kernels.tree_attention import Partials
from trace_jax.kernels.tree_attention import dense_attention_oracle
from trace_jax.kernels.tree_attention import merge_partials
from trace_jax.kernels.tree_attention import merge_split_partials
from trace_jax.kernels.tree_attention import normalize_partials
from trace_jax.kernels.tree_attention import paged_attention_reference
from trace_jax.kernels.tree_attention import resolve_impl
from trace_jax.kernels.tree_attention import tree_attention
from trace_jax.kernels.tree_attention import tree_attention_pallas
from trace_jax.kernels.tree_attention import tree_attention_reference

__all__ = [
    "IMPL_ENV_VAR",
    "MASK_VALUE",
    "Partials",
    "dense_attention_oracle",
    "merge_partials",
    "merge_split_partials",
    "normalize_partials",
    "paged_attention_reference",
    "resolve_impl",
    "tree_attention",
    "tree_attention_pallas",
    "tree_attention_reference",
]
