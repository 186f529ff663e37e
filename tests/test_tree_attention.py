"""Tree decode attention: Pallas (interpret) vs jnp reference vs a dense oracle on random trees."""

import dataclasses

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import kernels as ta

TOL = {jnp.float32: dict(atol=2e-5, rtol=2e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@dataclasses.dataclass
class Tree:
  # (q, k_pages, v_pages, group_pages, group_lens, group_slots, suffix_pages, suffix_lens)
  args: tuple
  k_seq: jax.Array  # [S, T, Hkv, D]: each slot's prefix tokens then its suffix tokens, zero padded
  v_seq: jax.Array
  lens: jax.Array  # i32[S] total tokens per slot


def make_tree(
    seed, *, num_slots=6, num_kv_heads=2, q_per_kv=4, head_dim=16, page_size=4, num_groups=3,
    branches=3, prefix_pages=3, suffix_pages=2, dtype=jnp.float32,
):
  """A random tree over a shuffled page pool, with the edge cases the sampler produces.

  Group 0 always has an empty prefix, the last slot is in no group and has no suffix (no tokens
  at all), some slots are in no group, prefix and suffix lengths end mid-page, and page-table
  padding points at other live pages so a masking bug would show.
  """
  rng = np.random.default_rng(seed)
  s, hkv, d, ps = num_slots, num_kv_heads, head_dim, page_size
  num_pages = num_groups * prefix_pages + s * suffix_pages + 1
  perm = rng.permutation(num_pages)
  k_pool = rng.standard_normal((num_pages, ps, hkv, d)).astype(np.float32)
  v_pool = rng.standard_normal((num_pages, ps, hkv, d)).astype(np.float32)

  group_pages = perm[: num_groups * prefix_pages].reshape(num_groups, prefix_pages)
  suffix_tab = perm[num_groups * prefix_pages :][: s * suffix_pages].reshape(s, suffix_pages)
  group_lens = rng.integers(0, prefix_pages * ps + 1, num_groups)
  group_lens[0] = 0
  suffix_lens = rng.integers(0, suffix_pages * ps + 1, s)
  suffix_lens[-1] = 0

  group_slots = np.full((num_groups, branches), -1)
  order = rng.permutation(s - 1)  # the last slot stays out of every group
  pos = 0
  for g in range(num_groups):
    nb = int(rng.integers(1, branches + 1))
    take = order[pos : pos + nb]
    group_slots[g, : len(take)] = take
    pos += len(take)

  # Table entries past the valid pages are arbitrary (in range): point them at random live pages.
  for tab, lens in ((group_pages, group_lens), (suffix_tab, suffix_lens)):
    for r in range(tab.shape[0]):
      used = -(-int(lens[r]) // ps)
      tab[r, used:] = rng.integers(0, num_pages, tab.shape[1] - used)

  # Dense per-slot sequences for the oracle.
  t = prefix_pages * ps + suffix_pages * ps
  k_seq = np.zeros((s, t, hkv, d), np.float32)
  v_seq = np.zeros((s, t, hkv, d), np.float32)
  lens = np.zeros(s, np.int64)
  slot_group = {int(x): g for g in range(num_groups) for x in group_slots[g] if x >= 0}
  for slot in range(s):
    ks, vs = [], []
    if slot in slot_group:
      g = slot_group[slot]
      ks.append(k_pool[group_pages[g]].reshape(-1, hkv, d)[: group_lens[g]])
      vs.append(v_pool[group_pages[g]].reshape(-1, hkv, d)[: group_lens[g]])
    ks.append(k_pool[suffix_tab[slot]].reshape(-1, hkv, d)[: suffix_lens[slot]])
    vs.append(v_pool[suffix_tab[slot]].reshape(-1, hkv, d)[: suffix_lens[slot]])
    kk, vv = np.concatenate(ks), np.concatenate(vs)
    lens[slot] = len(kk)
    k_seq[slot, : len(kk)], v_seq[slot, : len(vv)] = kk, vv

  q = rng.standard_normal((s, hkv * q_per_kv, d)).astype(np.float32)
  i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
  cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
  args = (
      cast(q), cast(k_pool), cast(v_pool), i32(group_pages), i32(group_lens), i32(group_slots),
      i32(suffix_tab), i32(suffix_lens),
  )
  # The oracle sees the same (possibly bf16-rounded) values as the kernels.
  return Tree(args, cast(k_seq), cast(v_seq), i32(lens))


def oracle(tree, **kw):
  return ta.dense_attention_oracle(tree.args[0], tree.k_seq, tree.v_seq, tree.lens, **kw)


def assert_close(actual, expected, dtype):
  assert actual.dtype == expected.dtype
  a, e = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
  assert np.isfinite(a).all()
  np.testing.assert_allclose(a, e, **TOL[dtype])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("q_per_kv", [1, 4, 8])
def test_reference_matches_dense_oracle(q_per_kv, dtype):
  for seed in range(3):
    tree = make_tree(seed, q_per_kv=q_per_kv, dtype=dtype)
    expected = oracle(tree)
    assert_close(ta.tree_attention_reference(*tree.args), expected, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("q_per_kv", [1, 4, 8])
def test_pallas_interpret_matches_reference_and_oracle(q_per_kv, dtype):
  tree = make_tree(10 + q_per_kv, q_per_kv=q_per_kv, dtype=dtype)
  out = ta.tree_attention_pallas(*tree.args, interpret=True)
  assert_close(out, ta.tree_attention_reference(*tree.args), dtype)
  assert_close(out, oracle(tree), dtype)


def test_slot_without_tokens_is_zero_not_nan():
  tree = make_tree(3)
  lens = np.asarray(tree.lens)
  assert lens[-1] == 0  # make_tree guarantees one slot with no tokens
  for out in (
      ta.tree_attention_reference(*tree.args),
      ta.tree_attention_pallas(*tree.args, interpret=True),
  ):
    out = np.asarray(out)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[lens == 0], 0.0)
    assert np.abs(out[lens > 0]).sum(axis=(1, 2)).min() > 0


def test_many_branches_span_several_row_blocks_and_pages_per_block():
  # 20 branches x 4 q heads = 80 rows > 64 -> two row blocks per group; block_k=8 with pages of 4
  # tokens -> 2 pages gathered per step.
  tree = make_tree(
      7, num_slots=22, num_kv_heads=1, q_per_kv=4, num_groups=1, branches=20, prefix_pages=3
  )
  out = ta.tree_attention_pallas(*tree.args, block_k=8, interpret=True)
  assert_close(out, oracle(tree), jnp.float32)


@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_key_splits(num_splits):
  # block_k=4 with pages of 4 tokens -> 4 key blocks per prefix table; 8 splits clamp to 4.
  tree = make_tree(8, num_groups=2, branches=3, prefix_pages=4, q_per_kv=2)
  out = ta.tree_attention_pallas(*tree.args, block_k=4, num_splits=num_splits, interpret=True)
  assert_close(out, oracle(tree), jnp.float32)


def test_bad_shapes_raise():
  tree = make_tree(0, num_kv_heads=2, q_per_kv=2)
  q = tree.args[0][:, :3]  # 3 q heads over 2 kv heads
  with pytest.raises(ValueError, match="multiple"):
    ta.tree_attention_reference(q, *tree.args[1:])
  with pytest.raises(ValueError, match="suffix"):
    ta.tree_attention_pallas(*tree.args[:6], tree.args[6][:-1], tree.args[7], interpret=True)


def test_custom_scale():
  tree = make_tree(4)
  out = ta.tree_attention_reference(*tree.args, sm_scale=0.3)
  assert_close(out, oracle(tree, sm_scale=0.3), jnp.float32)
  out = ta.tree_attention_pallas(*tree.args, sm_scale=0.3, interpret=True)
  assert_close(out, oracle(tree, sm_scale=0.3), jnp.float32)


def test_paged_attention_reference_matches_oracle():
  tree = make_tree(5, q_per_kv=2)
  q, k_pages, v_pages, *_, suffix_pages, suffix_lens = tree.args
  out = ta.paged_attention_reference(q, k_pages, v_pages, suffix_pages, suffix_lens)
  # Suffix-only sequences: take them from a tree whose groups are all empty.
  no_prefix = tree.args[:4] + (jnp.zeros_like(tree.args[4]),) + tree.args[5:]
  assert_close(out, ta.tree_attention_reference(*no_prefix), jnp.float32)
  lens = np.asarray(suffix_lens)
  k_seq = np.asarray(k_pages)[np.asarray(suffix_pages)].reshape(len(lens), -1, *k_pages.shape[2:])
  v_seq = np.asarray(v_pages)[np.asarray(suffix_pages)].reshape(len(lens), -1, *v_pages.shape[2:])
  assert_close(out, ta.dense_attention_oracle(q, k_seq, v_seq, suffix_lens), jnp.float32)


def test_merge_partials_equals_attention_over_the_union():
  rng = np.random.default_rng(0)
  logits = rng.standard_normal((3, 10)).astype(np.float32) * 4
  values = rng.standard_normal((3, 10, 5)).astype(np.float32)

  def partial(lo, hi):
    s, v = logits[:, lo:hi], values[:, lo:hi]
    m = s.max(-1) if hi > lo else np.full(3, ta.MASK_VALUE, np.float32)
    e = np.exp(s - m[:, None])
    return ta.Partials(o=jnp.asarray(np.einsum("rt,rtd->rd", e, v)), m=jnp.asarray(m),
                       l=jnp.asarray(e.sum(-1)))

  w = np.exp(logits - logits.max(-1, keepdims=True))
  expected = np.einsum("rt,rtd->rd", w / w.sum(-1, keepdims=True), values)
  for split in (0, 4, 10):
    merged = ta.merge_partials(partial(0, split), partial(split, 10))
    np.testing.assert_allclose(ta.normalize_partials(merged), expected, atol=1e-5, rtol=1e-5)
  empty = ta.merge_partials(partial(0, 0), partial(10, 10))
  np.testing.assert_array_equal(ta.normalize_partials(empty), 0.0)


def test_prefix_phase_is_one_matmul_over_all_branches():
  # The shared prefix must be contracted once per group with all B*G branch rows stacked.
  tree = make_tree(1, num_groups=3, branches=3, q_per_kv=4, num_kv_heads=2, head_dim=16)
  jaxpr = str(jax.make_jaxpr(ta.tree_attention_reference)(*tree.args))
  dots = [line for line in jaxpr.splitlines() if "dot_general" in line]
  # logits [NG=3, Hkv=2, B*G=3*4 rows, Pg*page_size=3*4 keys]
  assert any("f32[3,2,12,12] = dot_general" in line for line in dots), dots


def test_dispatch(monkeypatch):
  tree = make_tree(2)
  expected = ta.tree_attention_reference(*tree.args)
  monkeypatch.delenv(ta.IMPL_ENV_VAR, raising=False)
  assert ta.resolve_impl() == ("pallas" if jax.default_backend() == "gpu" else "reference")
  monkeypatch.setenv(ta.IMPL_ENV_VAR, "pallas_interpret")
  assert ta.resolve_impl() == "pallas_interpret"
  assert ta.resolve_impl("reference") == "reference"  # the argument wins over the env var
  assert_close(ta.tree_attention(*tree.args), expected, jnp.float32)
  monkeypatch.setenv(ta.IMPL_ENV_VAR, "bogus")
  with pytest.raises(ValueError):
    ta.tree_attention(*tree.args)


@pytest.mark.parametrize(
    "dtype, shape",
    [
        (jnp.float32, dict()),
        (jnp.bfloat16, dict()),
        # Sampler-sized: 40 branches x 8 q heads per kv head -> 320 rows in 5 row blocks; prefix
        # tables of 12 pages (not a power of two), split over keys.
        (jnp.bfloat16, dict(num_slots=48, num_groups=2, branches=40, q_per_kv=8, head_dim=128,
                            prefix_pages=12, suffix_pages=5)),
    ],
)
def test_pallas_lowers_for_cuda(dtype, shape):
  shape = dict(dict(num_kv_heads=2, q_per_kv=4, head_dim=64, page_size=16), **shape)
  tree = make_tree(0, dtype=dtype, **shape)
  lowered = jax.jit(ta.tree_attention_pallas).trace(*tree.args).lower(lowering_platforms=("cuda",))
  text = lowered.as_text()
  # One Triton kernel for the prefix phase and one for the suffix phase.
  assert text.count("__gpu$xla.gpu.triton") == 2


@hypothesis.settings(max_examples=4, deadline=None, derandomize=True)
@hypothesis.given(
    seed=st.integers(0, 2**16),
    num_slots=st.integers(2, 7),
    num_kv_heads=st.sampled_from([1, 2]),
    q_per_kv=st.sampled_from([1, 2, 4]),
    page_size=st.sampled_from([2, 4, 8]),
    num_groups=st.integers(1, 3),
    branches=st.integers(1, 4),
    prefix_pages=st.integers(1, 4),
    suffix_pages=st.integers(1, 3),
)
def test_random_shapes(seed, **shape):
  tree = make_tree(seed, head_dim=8, **shape)
  expected = oracle(tree)
  assert_close(ta.tree_attention_reference(*tree.args), expected, jnp.float32)
  assert_close(ta.tree_attention_pallas(*tree.args, interpret=True), expected, jnp.float32)
