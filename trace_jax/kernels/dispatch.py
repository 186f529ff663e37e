"""Picks a tree-attention backend: `resolve_impl` and the `tree_attention` entry point.

Backends (all with the contract in `partials`): "reference" (`reference`, pure jnp, the CPU path),
"pallas" (`gpu`, the Triton kernel), "pallas_tpu" (`tpu`, the Mosaic kernel), and the "*_interpret"
variants that run a kernel with the Pallas interpreter (CPU tests). The choice comes from the
argument, else $TRACE_JAX_ATTENTION_IMPL, else the JAX backend.

This module sits above the backends: it imports them, none of them imports it. Backends are called
through their modules (`tpu.tree_attention_tpu`, not a name bound at import), so a test can patch
one backend module and see `tree_attention` use the patch.
"""

from __future__ import annotations

import os

import jax

from trace_jax.kernels import gpu, reference, tpu

IMPL_ENV_VAR = "TRACE_JAX_ATTENTION_IMPL"
IMPLS = ("auto", "reference", "pallas", "pallas_interpret", "pallas_tpu", "pallas_tpu_interpret")


def resolve_impl(impl: str = "auto") -> str:
  """Picks the implementation: argument, else $TRACE_JAX_ATTENTION_IMPL, else by backend.

  "auto" means the Triton kernel ("pallas") on GPU, the Mosaic kernel ("pallas_tpu") on TPU and
  the reference elsewhere (CPU). "pallas" asked for explicitly on TPU means the Mosaic kernel.
  The "*_interpret" impls run a kernel with the Pallas interpreter (CPU tests).
  """
  if impl == "auto":
    impl = os.environ.get(IMPL_ENV_VAR, "auto") or "auto"
  if impl not in IMPLS:
    raise ValueError(f"unknown attention impl {impl!r}; expected one of {IMPLS}")
  backend = jax.default_backend()
  if impl == "auto":
    impl = {"gpu": "pallas", "tpu": "pallas_tpu"}.get(backend, "reference")
  if impl == "pallas" and backend == "tpu":
    impl = "pallas_tpu"
  return impl


def tree_attention(
    q, k_pages, v_pages, group_pages, group_lens, group_slots, suffix_pages, suffix_lens,
    *, sm_scale=None, impl="auto",
):
  """Tree decode attention; impl in IMPLS (see `resolve_impl`).

  Sibling branches (slots) of a group attend to the group's shared prefix pages, read once for all
  of them, then each to its own suffix pages; the two partial softmaxes merge by log-sum-exp.
  Arguments as `tree_attention_reference` (q [S, Hq, D], pools [num_pages, page_size, Hkv, D],
  group_pages i32[NG, Pg], group_lens i32[NG], group_slots i32[NG, B], suffix_pages i32[S, Ps],
  suffix_lens i32[S]); `impl` picks the implementation (`resolve_impl`: "auto" is the Triton kernel
  on GPU, the Mosaic kernel on TPU, the reference elsewhere).

  Returns:
    [S, Hq, D] in q.dtype.

  Example:
    >>> k, v = jax.random.normal(jax.random.key(0), (2, 8, 4, 1, 16))  # 8 pages of 4 tokens
    >>> q = jax.random.normal(jax.random.key(1), (2, 2, 16))  # 2 branches, 2 q heads, 1 kv head
    >>> args = (q, k, v, jnp.array([[1, 2]]), jnp.array([8]), jnp.array([[0, 1]]),
    ...         jnp.array([[3], [4]]), jnp.array([2, 3]))  # prefix: pages 1-2, suffixes: 3 and 4
    >>> out = tree_attention(*args, impl="pallas_interpret")  # the GPU kernel, interpreted
    >>> bool(jnp.allclose(out, tree_attention_reference(*args), atol=1e-5))
    True
  """
  impl = resolve_impl(impl)
  args = (q, k_pages, v_pages, group_pages, group_lens, group_slots, suffix_pages, suffix_lens)
  if impl == "reference":
    return reference.tree_attention_reference(*args, sm_scale=sm_scale)
  if impl in ("pallas_tpu", "pallas_tpu_interpret"):
    interpret = tpu.interpret_params() if impl == "pallas_tpu_interpret" else False
    return tpu.tree_attention_tpu(*args, sm_scale=sm_scale, interpret=interpret)
  return gpu.tree_attention_pallas(*args, sm_scale=sm_scale, interpret=impl == "pallas_interpret")
