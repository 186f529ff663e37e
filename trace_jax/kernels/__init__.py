"""Attention kernels: tree (cascade) decode attention over a paged KV pool.

`trace_jax.kernels.tree_attention` here is the dispatching function; the module of the same name
is reached with `from trace_jax.kernels.tree_attention import ...` or importlib. The package
re-exports the module's public names (its `__all__`).
"""

from trace_jax.kernels.tree_attention import *  # noqa: F403
from trace_jax.kernels.tree_attention import __all__  # noqa: F401
