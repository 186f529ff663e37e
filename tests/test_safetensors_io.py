"""Safetensors I/O on the `safetensors` package: lazy views, exact shard reads, clear errors."""

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from trace_jax.models.safetensors_io import SafetensorsFile, TensorView, save_file


def _recording_view(a, log):
  def read(idx):
    log.append(idx)
    return a[idx]
  return TensorView(read, a.shape, a.dtype, "x")


def test_round_trip_with_bf16_and_metadata(tmp_path):
  rs = np.random.RandomState(0)
  tensors = {"w": rs.randn(6, 4).astype(ml_dtypes.bfloat16), "b": rs.randn(5).astype(np.float32),
             "i": np.arange(3, dtype=np.int32), "s": np.array(2.5, np.float32)}
  path = str(tmp_path / "m.safetensors")
  save_file(tensors, path, metadata={"step": 3})
  f = SafetensorsFile(path)
  assert sorted(f.keys()) == ["b", "i", "s", "w"] and f.metadata == {"format": "pt", "step": "3"}
  for k, v in tensors.items():
    got = np.asarray(f[k])
    assert got.dtype == v.dtype and got.shape == v.shape
    np.testing.assert_array_equal(got, v)
  # The library itself reads what we wrote (bf16 dtype tag included).
  with safe_open(path, framework="numpy") as g:
    assert g.get_slice("w").get_dtype() == "BF16"


@pytest.mark.parametrize("view", ["ident", "T", "proj_in", "o_proj", "bias"])
def test_views_index_like_numpy_and_read_only_the_slice(view):
  d, n, hd = 6, 4, 3
  rs = np.random.RandomState(1)
  base = {"ident": rs.randn(d, 5), "T": rs.randn(5, d), "proj_in": rs.randn(n * hd, d),
          "o_proj": rs.randn(d, n * hd), "bias": rs.randn(n * hd)}[view].astype(np.float32)
  fns = {"ident": lambda a: a, "T": lambda a: a.T,
         "proj_in": lambda a: a.T.reshape(d, n, hd),        # HF [n*hd, d] -> ours [d, n, hd]
         "o_proj": lambda a: a.T.reshape(n, hd, d),         # HF [d, n*hd] -> ours [n, hd, d]
         "bias": lambda a: a.reshape(n, hd)}
  want = fns[view](base)
  log = []
  v = fns[view](_recording_view(base, log))
  assert isinstance(v, TensorView) and v.shape == want.shape
  np.testing.assert_array_equal(np.asarray(v), want)
  for idx in [(slice(0, 2),), (slice(2, 4), slice(1, 3)), (1,), (slice(None), slice(None), 0),
              (Ellipsis, slice(1, 2))]:
    idx = idx[:want.ndim] if Ellipsis not in idx else idx
    np.testing.assert_array_equal(v[idx], want[idx], err_msg=str(idx))
  # A device's shard of the heads axis reads exactly those heads' rows of the fused HF axis.
  if view == "proj_in":
    log.clear()
    got = v[:, 1:3, :]
    np.testing.assert_array_equal(got, want[:, 1:3])
    assert log == [(slice(1 * hd, 3 * hd), slice(0, d))]
  if view == "T":
    log.clear()
    v[2:4]
    assert log == [(slice(0, 5), slice(2, 4))]


def test_sharded_read_from_a_real_file_matches(tmp_path):
  a = np.random.RandomState(2).randn(8, 12).astype(ml_dtypes.bfloat16)
  path = str(tmp_path / "x.safetensors")
  save_file({"a": a}, path)
  v = SafetensorsFile(path)["a"].T.reshape(3, 4, 8)
  np.testing.assert_array_equal(v[1:2, :, 4:8], a.T.reshape(3, 4, 8)[1:2, :, 4:8])


def test_errors_name_the_file_and_tensor(tmp_path):
  with pytest.raises(FileNotFoundError, match="not found"):
    SafetensorsFile(str(tmp_path / "missing.safetensors"))
  path = str(tmp_path / "t.safetensors")
  save_file({"a": np.zeros((64, 64), np.float32)}, path)
  with open(path, "rb") as fh:
    data = fh.read()
  with open(path, "wb") as fh:
    fh.write(data[: len(data) // 2])
  with pytest.raises(ValueError, match="t.safetensors"):
    SafetensorsFile(path)
  with open(path, "wb") as fh:
    fh.write(b"\x03")
  with pytest.raises(ValueError, match="t.safetensors"):
    SafetensorsFile(path)
  save_file({"a": np.zeros(2, np.float32)}, path)
  with pytest.raises(KeyError, match="no tensor named 'b'"):
    SafetensorsFile(path)["b"]
  with pytest.raises(ValueError, match="cannot be stored"):
    save_file({"c": np.zeros(2, np.complex64)}, path)
