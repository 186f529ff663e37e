"""Meshes, logical sharding rules and multi-host initialization."""

from trace_jax.parallel.distributed import initialize
from trace_jax.parallel.sharding import (DEFAULT_RULES, MESH_AXES, batch_sharding,
                                         describe_fallbacks, logical_to_spec, make_mesh,
                                         parse_mesh_spec, shard_batch, shard_state,
                                         state_shardings, state_specs)

__all__ = ["DEFAULT_RULES", "MESH_AXES", "batch_sharding", "describe_fallbacks", "initialize",
           "logical_to_spec", "make_mesh", "parse_mesh_spec", "shard_batch", "shard_state",
           "state_shardings", "state_specs"]
