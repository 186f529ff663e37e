"""Attention kernels: tree (cascade) decode attention over a paged KV pool.

`trace_jax.kernels.tree_attention` here is the dispatching function; the module of the same name
is reached with `from trace_jax.kernels.tree_attention import ...` or importlib. The package
re-exports the module's public names (its `__all__`), the TPU kernel `tree_attention_tpu` (module
`tree_attention_tpu`, shadowed alike) and the `shard_map` wrapper `tree_attention_sharded`.
"""

from trace_jax.kernels.tree_attention import *  # noqa: F403
from trace_jax.kernels.tree_attention import __all__  # noqa: F401
from trace_jax.kernels.tree_attention_sharded import tree_attention_sharded  # noqa: F401
from trace_jax.kernels.tree_attention_tpu import (  # noqa: F401
    paged_partials_tpu,
    tree_attention_tpu,
)

__all__ = __all__ + ["paged_partials_tpu", "tree_attention_sharded", "tree_attention_tpu"]
