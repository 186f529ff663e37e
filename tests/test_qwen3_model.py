"""The padding, segment and cache contract of our Qwen3, and presets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trace_jax.models.qwen3 import PRESETS, Qwen3, Qwen3Config, get_preset


@pytest.fixture(scope="module")
def model():
  cfg = get_preset("tiny", vocab_size=97, num_layers=2)
  return Qwen3(cfg, rngs=nnx.Rngs(0))


def test_incremental_decoding_equals_full_forward(model):
  x = jnp.asarray(np.random.RandomState(0).randint(0, 97, (2, 13)))
  full = model(x)
  cache = model.init_cache(2, 32)
  logits, cache = model(x[:, :5], cache=cache)
  steps = [logits]
  for t in range(5, 13):
    logits, cache = model(x[:, t:t + 1], cache=cache)
    steps.append(logits)
  inc = jnp.concatenate(steps, axis=1)
  np.testing.assert_allclose(np.asarray(inc), np.asarray(full), atol=2e-5)
  assert cache["lens"].tolist() == [13, 13]


def test_ragged_cache_with_right_padding(model):
  rs = np.random.RandomState(1)
  a, b = rs.randint(0, 97, 7), rs.randint(0, 97, 4)
  toks = np.zeros((2, 7), np.int32)
  toks[0], toks[1, :4] = a, b
  mask = np.zeros((2, 7), bool)
  mask[0], mask[1, :4] = True, True
  cache = model.init_cache(2, 16)
  _, cache = model(jnp.asarray(toks), cache=cache, attn_mask=jnp.asarray(mask))
  assert cache["lens"].tolist() == [7, 4]
  nxt = jnp.asarray([[5], [6]])
  step, _ = model(nxt, cache=cache)
  ref_a = model(jnp.asarray(np.r_[a, 5])[None])[0, -1]
  ref_b = model(jnp.asarray(np.r_[b, 6])[None])[0, -1]
  np.testing.assert_allclose(np.asarray(step[0, 0]), np.asarray(ref_a), atol=2e-5)
  np.testing.assert_allclose(np.asarray(step[1, 0]), np.asarray(ref_b), atol=2e-5)


def test_padding_is_never_attended(model):
  rs = np.random.RandomState(2)
  x = rs.randint(0, 97, (1, 6))
  padded = np.concatenate([x, rs.randint(0, 97, (1, 3))], axis=1)
  mask = np.r_[np.ones(6, bool), np.zeros(3, bool)][None]
  got = model(jnp.asarray(padded), attn_mask=jnp.asarray(mask))
  ref = model(jnp.asarray(x))
  np.testing.assert_allclose(np.asarray(got[:, :6]), np.asarray(ref), atol=1e-5)
  assert np.isfinite(np.asarray(got)).all()


def test_packed_segments_equal_separate_sequences(model):
  rs = np.random.RandomState(3)
  a, b = rs.randint(1, 97, 5), rs.randint(1, 97, 4)
  toks = np.r_[a, b, 0][None]
  seg = np.r_[np.ones(5), 2 * np.ones(4), 0][None].astype(np.int32)
  pos = np.r_[np.arange(5), np.arange(4), 0][None].astype(np.int32)
  got = model(jnp.asarray(toks), positions=jnp.asarray(pos), segment_ids=jnp.asarray(seg))
  np.testing.assert_allclose(np.asarray(got[0, :5]), np.asarray(model(jnp.asarray(a)[None])[0]),
                             atol=1e-5)
  np.testing.assert_allclose(np.asarray(got[0, 5:9]), np.asarray(model(jnp.asarray(b)[None])[0]),
                             atol=1e-5)


def test_bf16_compute_runs_and_every_param_has_logical_axes():
  cfg = get_preset("tiny", vocab_size=64, dtype="bfloat16", param_dtype="bfloat16")
  m = Qwen3(cfg, rngs=nnx.Rngs(0))
  out = m(jnp.zeros((1, 4), jnp.int32))
  assert out.dtype == jnp.float32 and np.isfinite(np.asarray(out)).all()
  for path, v in nnx.to_flat_state(nnx.state(m, nnx.Param)):
    axes = getattr(v, "logical_axes", None)
    assert axes is not None and len(axes) == v[...].ndim, path
    assert v[...].dtype == jnp.bfloat16


def test_presets_have_real_qwen3_sizes():
  n = {}
  for name in ("qwen3_0p6b", "qwen3_8b", "qwen3_14b"):
    abstract = nnx.eval_shape(lambda: Qwen3(PRESETS[name], rngs=nnx.Rngs(0)))
    n[name] = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract)))
  assert 0.55e9 < n["qwen3_0p6b"] < 0.65e9
  assert 8.0e9 < n["qwen3_8b"] < 8.4e9
  assert 14.5e9 < n["qwen3_14b"] < 15.0e9


def test_bad_config_is_rejected():
  with pytest.raises(ValueError, match="num_kv_heads"):
    Qwen3Config(vocab_size=10, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=3,
                num_kv_heads=2, head_dim=4)
  with pytest.raises(KeyError, match="unknown Qwen3 preset"):
    get_preset("qwen3_99b")
  with pytest.raises(ValueError, match="dtype"):
    get_preset("tiny", dtype="float8")
