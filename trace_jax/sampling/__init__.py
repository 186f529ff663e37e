"""The generic tree sampler: a continuous-batching engine over a paged KV pool, with forks from
anchors. It knows no task and no method: a task is reached through the environment adapter it is
given, a method through the requests the driver issues."""
