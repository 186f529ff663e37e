"""Attention kernels: tree (cascade) decode attention over a paged KV pool.

One module per backend, each importing only the ones above it in this list (no cycle):

  partials   layout contract, `Partials` and their log-sum-exp merges, argument checks, row layouts
  reference  pure jnp: `tree_attention_reference` (CPU path), `paged_attention_reference`,
             `paged_partials_reference`, `dense_attention_oracle` (test oracle)
  gpu        Pallas Triton kernel `tree_attention_pallas` (block sizes explained there)
  tpu        Pallas Mosaic kernel `tree_attention_tpu` and its core `paged_partials_tpu`
  dispatch   `resolve_impl`, IMPL_ENV_VAR / IMPLS and `tree_attention`, which picks a backend
  sharded    `tree_attention_sharded`: `tree_attention` under `shard_map` on a mesh

The package re-exports the public functions and constants; no module shares a name with one of
them, so `trace_jax.kernels.tree_attention` is the dispatching function and the modules are
reached as `trace_jax.kernels.<module>`.
"""

from trace_jax.kernels.dispatch import IMPL_ENV_VAR, IMPLS, resolve_impl, tree_attention
from trace_jax.kernels.gpu import tree_attention_pallas
from trace_jax.kernels.partials import (MASK_VALUE, Partials, merge_partials, merge_split_partials,
                                        normalize_partials)
from trace_jax.kernels.reference import (dense_attention_oracle, paged_attention_reference,
                                         paged_partials_reference, tree_attention_reference)
from trace_jax.kernels.sharded import tree_attention_sharded
from trace_jax.kernels.tpu import paged_partials_tpu, tree_attention_tpu

__all__ = [
    "IMPLS",
    "IMPL_ENV_VAR",
    "MASK_VALUE",
    "Partials",
    "dense_attention_oracle",
    "merge_partials",
    "merge_split_partials",
    "normalize_partials",
    "paged_attention_reference",
    "paged_partials_reference",
    "paged_partials_tpu",
    "resolve_impl",
    "tree_attention",
    "tree_attention_pallas",
    "tree_attention_reference",
    "tree_attention_sharded",
    "tree_attention_tpu",
]
