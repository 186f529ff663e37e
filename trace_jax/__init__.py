"""trace_jax: Tree Rollout Allocation for Contrastive Exploration, in JAX."""

__version__ = "0.1.0"
