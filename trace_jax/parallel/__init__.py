"""Meshes, logical sharding rules and multi-host initialization."""

from trace_jax.parallel.distributed import (allgather_object, check_agree, fetch, initialize,
                                             local_mesh, put_global, to_local)
from trace_jax.parallel.micro_batch import (merge_micro_batches, row_axes, row_shards,
                                            split_micro_batches)
from trace_jax.parallel.sharding import (DEFAULT_RULES, MESH_AXES, batch_sharding,
                                         describe_fallbacks, logical_to_spec, make_mesh,
                                         parse_mesh_spec, shard_batch, shard_state,
                                         state_shardings, state_specs)

__all__ = ["DEFAULT_RULES", "MESH_AXES", "allgather_object", "batch_sharding", "check_agree",
           "describe_fallbacks", "fetch", "initialize", "local_mesh", "put_global", "to_local",
           "logical_to_spec", "make_mesh", "merge_micro_batches", "parse_mesh_spec", "row_axes",
           "row_shards", "shard_batch", "shard_state", "split_micro_batches", "state_shardings",
           "state_specs"]
