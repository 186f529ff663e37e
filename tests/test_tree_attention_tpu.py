"""TPU (Mosaic) tree-attention kernel: TPU interpret mode against the reference, TPU lowering.

Interpret mode runs the kernel's DMAs, semaphores and VMEM scratch on CPU with race detection and
fresh buffers filled with NaN, so a read of a block that was never copied shows up as NaN.
Interpret compiles are slow (seconds each): shapes are tiny and shared between tests where possible.
"""

import functools
import importlib.util
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from devices import run_on_devices
from test_tree_attention import assert_close, make_tree, oracle
from trace_jax import kernels as ta
from trace_jax.kernels import tpu as tt

# One settings object for every interpret call: equal settings hit the jit cache.
INTERPRET = tt.interpret_params()
# The interpreted kernels are large CPU programs; optimizing them costs more than running them.
FAST_COMPILE = {"xla_backend_optimization_level": 0}
TPU_KINDS = {"v5e": "TPU v5 lite", "v5p": "TPU v5", "v6e": "TPU v6 lite"}
COMPILE_SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "tpu_compile_tree_attention.py")


def assert_no_races():
  """The interpreter's race detector found nothing in the last kernel it ran."""
  try:
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
  except ImportError:  # pragma: no cover - older jax: detection unavailable
    return
  races = getattr(ipc, "races", None)
  assert races is not None and not races.races_found


@functools.partial(jax.jit, static_argnames=("block_k", "kv_heads_per_block", "num_splits"),
                   compiler_options=FAST_COMPILE)
def core_tpu(rows, k_pages, v_pages, tables, lens, *, block_k, kv_heads_per_block=None,
             num_splits=1):
  return tt.paged_partials_tpu(rows, k_pages, v_pages, tables, lens, 0.5, block_k=block_k,
                               kv_heads_per_block=kv_heads_per_block, num_splits=num_splits,
                               interpret=INTERPRET)


@functools.partial(jax.jit, compiler_options=FAST_COMPILE)
def tree_tpu(*args):
  return tt.tree_attention_tpu(*args, block_k=8, interpret=INTERPRET)


def core_reference(rows, k_pages, v_pages, tables, lens):
  return ta.paged_partials_reference(rows, k_pages, v_pages, tables, lens, 0.5)


def make_core_case(seed, *, num_pages=13, page_size=4, num_kv_heads=2, rows=6, head_dim=16,
                   table_pages=5, lens=(0, 1, 4, 7, 20, 13)):
  """Row groups over a shuffled pool; table entries past each length point at other live pages."""
  rng = np.random.default_rng(seed)
  n = len(lens)
  k = rng.standard_normal((num_pages, page_size, num_kv_heads, head_dim)).astype(np.float32)
  v = rng.standard_normal((num_pages, page_size, num_kv_heads, head_dim)).astype(np.float32)
  tables = np.stack([rng.permutation(num_pages)[:table_pages] for _ in range(n)])
  q = rng.standard_normal((n, num_kv_heads, rows, head_dim)).astype(np.float32)
  return q, k, v, tables.astype(np.int32), np.asarray(lens, np.int32)


def assert_partials_close(actual, expected, atol=2e-5):
  for name, a, e in zip(ta.Partials._fields, actual, expected):
    a, e = np.asarray(a), np.asarray(e)
    assert np.isfinite(a).all(), name
    np.testing.assert_allclose(a, e, atol=atol, rtol=atol, err_msg=name)


# ---------------------------------------------------------------------------------------------
# Interpret mode against the reference.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("q_per_kv, dtype", [(1, jnp.float32), (2, jnp.bfloat16),
                                             (4, jnp.float32), (8, jnp.bfloat16)])
def test_tree_kernel_matches_reference_and_oracle(q_per_kv, dtype):
  # make_tree: an empty prefix (group 0), a slot without any token, slots in no group, lengths
  # ending mid-page, padding table ids pointing at live pages, a permuted pool. block_k=8 with
  # pages of 4 -> 2 pages per DMA block; 3-page prefix tables pad to 4 pages.
  tree = make_tree(20 + q_per_kv, num_slots=5, num_groups=2, branches=3, q_per_kv=q_per_kv,
                   dtype=dtype)
  out = tree_tpu(*tree.args)
  assert_no_races()
  assert_close(out, ta.tree_attention_reference(*tree.args), dtype)
  assert_close(out, oracle(tree), dtype)
  lens = np.asarray(tree.lens)
  np.testing.assert_array_equal(np.asarray(out, np.float32)[lens == 0], 0.0)


def test_several_pages_per_block_ragged_lengths_and_padded_tables():
  # 5-page tables, 3 pages per block -> 2 blocks, the second padded with id 0; lengths 0 (no
  # block), 1, one page, mid-page, the whole table (20 tokens) and a second-block mid-page.
  q, k, v, tables, lens = make_core_case(0)
  out = core_tpu(q, k, v, tables, lens, block_k=12)
  assert_no_races()
  expected = core_reference(q, k, v, tables, lens)
  assert_partials_close(out, expected)
  np.testing.assert_array_equal(np.asarray(out.l)[0], 0.0)  # no keys: empty partial
  np.testing.assert_array_equal(np.asarray(out.m)[0], np.float32(ta.MASK_VALUE))


def test_permuted_page_tables_give_the_same_result():
  # Moving every page to another pool slot and relabelling the tables must not change anything.
  q, k, v, tables, lens = make_core_case(1)
  perm = np.random.default_rng(2).permutation(k.shape[0])  # page i moves to slot perm[i]
  k2, v2 = np.empty_like(k), np.empty_like(v)
  k2[perm], v2[perm] = k, v
  out = core_tpu(q, k, v, tables, lens, block_k=12)
  out2 = core_tpu(q, k2, v2, perm[tables].astype(np.int32), lens, block_k=12)
  for a, b in zip(out, out2):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_stale_nan_past_the_length_does_not_leak():
  # Pool slots past a row group's length (the tail of its last page, its padding pages) may hold
  # anything, NaN included: the kernel masks keys and zeroes values there.
  q, k, v, tables, lens = make_core_case(3)
  used = np.zeros(k.shape[:2], bool)  # (page, token) holding a valid token of some row group
  for tab, n in zip(tables, lens):
    for t in range(n):
      used[tab[t // k.shape[1]], t % k.shape[1]] = True
  assert not used.all()
  k_nan, v_nan = k.copy(), v.copy()
  k_nan[~used], v_nan[~used] = np.nan, np.nan
  out = core_tpu(q, k_nan, v_nan, tables, lens, block_k=12)
  assert_partials_close(out, core_reference(q, k, v, tables, lens))


def test_kv_head_blocks_and_key_splits():
  # 4 KV heads in blocks of 2 (grid head axis of 2), one page per block and 3 key splits: the split
  # partials merge by log-sum-exp.
  q, k, v, tables, lens = make_core_case(4, num_kv_heads=4, rows=3)
  out = core_tpu(q, k, v, tables, lens, block_k=4, kv_heads_per_block=2, num_splits=3)
  assert_no_races()
  assert_partials_close(out, core_reference(q, k, v, tables, lens))


def test_bad_kv_head_block_raises():
  tree = make_tree(0, num_kv_heads=2, q_per_kv=2, dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="multiple of 2"):  # one bf16 head is half a sublane
    tt.tree_attention_tpu(*tree.args, kv_heads_per_block=1, interpret=INTERPRET)
  tree = make_tree(0, num_kv_heads=4, q_per_kv=1)
  with pytest.raises(ValueError, match="divide"):
    tt.tree_attention_tpu(*tree.args, kv_heads_per_block=3, interpret=INTERPRET)


def test_dispatch_picks_the_tpu_kernel_on_tpu(monkeypatch):
  monkeypatch.delenv(ta.IMPL_ENV_VAR, raising=False)
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  assert ta.resolve_impl() == "pallas_tpu"
  assert ta.resolve_impl("pallas") == "pallas_tpu"
  assert ta.resolve_impl("reference") == "reference"
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  assert ta.resolve_impl() == "reference"
  monkeypatch.setenv(ta.IMPL_ENV_VAR, "pallas_tpu_interpret")
  calls = []
  monkeypatch.setattr(tt, "tree_attention_tpu", lambda *a, **kw: calls.append(kw) or "tpu")
  tree = make_tree(0)
  assert ta.tree_attention(*tree.args) == "tpu"
  assert calls[0]["interpret"] == INTERPRET  # TPU interpret mode, races and NaN checks on


# ---------------------------------------------------------------------------------------------
# Lowering for TPU (no TPU here): Pallas -> Mosaic MLIR inside a TPU custom call.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("generation", sorted(TPU_KINDS))
def test_lowers_for_tpu(generation):
  # Sampler-like shapes: bf16, head_dim 128, 16-token pages, 8 q heads per kv head, 40 branches.
  tree = make_tree(0, num_slots=48, num_kv_heads=2, q_per_kv=8, head_dim=128, page_size=16,
                   num_groups=2, branches=40, prefix_pages=12, suffix_pages=5,
                   dtype=jnp.bfloat16)
  try:
    device = jax.sharding.AbstractDevice(device_kind=TPU_KINDS[generation], num_cores=1,
                                         platform="tpu")
  except TypeError:  # jax 0.8 takes no platform (lowering_platforms names it)
    device = jax.sharding.AbstractDevice(device_kind=TPU_KINDS[generation], num_cores=1)
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):
    lowered = jax.jit(tt.tree_attention_tpu).trace(*tree.args).lower(
        lowering_platforms=("tpu",))
  text = lowered.as_text()
  # One Mosaic kernel for the prefix phase and one for the suffix phase.
  assert text.count("stablehlo.custom_call @tpu_custom_call") == 2
  assert text.count('kernel_name = "tree_attention_tpu_') == 2


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed")
def test_compiles_with_mosaic_for_tpu():
  # With libtpu installed, compile ahead of time for TPU topologies (no TPU needed): this runs
  # the Mosaic compiler itself, which checks tiling and DMA alignment that lowering does not.
  env = dict(os.environ, TPU_SKIP_MDS_QUERY="1", TPU_WORKER_HOSTNAMES="localhost",
             TPU_ACCELERATOR_TYPE="v5litepod-4")
  proc = subprocess.run([sys.executable, COMPILE_SCRIPT, "--quick"], env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert proc.stdout.count("compiled") >= 3, proc.stdout


# ---------------------------------------------------------------------------------------------
# shard_map wrapper on 8 simulated devices (a fresh process: the device count is fixed at start).
# ---------------------------------------------------------------------------------------------



@pytest.mark.parametrize("impl", ["reference", "pallas_tpu_interpret"])
def test_sharded_on_mesh_matches_single_device_without_gathers(impl):
  # Mesh (data 2, fsdp 2, tensor 2): one tree per data shard with global page and slot ids, KV
  # heads split over tensor. Same result as the single-device reference, no all-gather in the HLO.
  result = run_on_devices("tree_attention_sharded.py", impl, timeout=300)
  assert result["finite"]
  assert result["max_err"] < 1e-5
  assert result["all_gathers"] == 0
  assert result["out_sharding"] == ["data", "tensor"]
