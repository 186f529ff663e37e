"""Safetensors reading and writing on the `safetensors` package, with lazy per-shard views.

`SafetensorsFile(path)[name]` is a `TensorView`: nothing is read until it is indexed. A loader that
builds a sharded parameter with `jax.make_array_from_callback` indexes the view with one device's
slice, and only the bytes of that slice are read (`safe_open(..., framework="numpy").get_slice`
over the library's memory map), so a large checkpoint is never materialized whole in host or device
memory. A view may be transposed and have axes split by `reshape` (HF stores linear layers as
[out, in] and fused heads as one axis) and still read only what an index needs. bfloat16 comes back
as an `ml_dtypes.bfloat16` numpy array.
"""

from __future__ import annotations

import math
import os

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors import numpy as st_numpy

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}
_STORABLE = {np.dtype(v) for v in _DTYPES.values()}


class TensorView:
  """A tensor of a safetensors file, read lazily; indexing reads only the bytes it needs.

  The view is the stored tensor transposed by `perm` and with each transposed axis split into the
  sizes of its `split` group (a C-order reshape that only splits axes). Indexing with slices reads,
  for every stored axis, the range covered by the outermost axis of its group (inner axes of a group
  are read whole and sliced after), so a slice over heads of a fused [heads * head_dim] axis reads
  exactly those heads.
  """

  def __init__(self, reader, shape, dtype, name: str, perm=None, split=None):
    self._reader = reader  # callable(tuple of slices over the stored shape) -> np.ndarray
    self._base_shape = tuple(int(s) for s in shape)
    self._perm = tuple(perm) if perm is not None else tuple(range(len(self._base_shape)))
    tshape = [self._base_shape[p] for p in self._perm]
    self._split = tuple(split) if split is not None else tuple((s,) for s in tshape)
    self.dtype = np.dtype(dtype)
    self.name = name

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(s for g in self._split for s in g)

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def nbytes(self) -> int:
    return self.size * self.dtype.itemsize

  def __len__(self):
    return self.shape[0]

  def __repr__(self):
    return f"TensorView({self.name!r}, shape={self.shape}, dtype={self.dtype})"

  def transpose(self, *axes) -> TensorView:
    axes = tuple(axes[0]) if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else axes
    if any(len(g) != 1 for g in self._split):  # transposing split axes: read it all
      return np.asarray(self).transpose(*axes)
    axes = axes or tuple(reversed(range(self.ndim)))
    return TensorView(self._reader, self._base_shape, self.dtype, self.name,
                      tuple(self._perm[a] for a in axes))

  @property
  def T(self) -> TensorView:  # numpy's name
    return self.transpose()

  def reshape(self, *shape):
    """Splits axes lazily; any other reshape reads the whole tensor first."""
    shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
    if -1 in shape:
      known = math.prod(s for s in shape if s != -1)
      shape = tuple(self.size // known if s == -1 else s for s in shape)
    groups, k = [], 0
    for g in self._split:
      size, group, prod = math.prod(g), [], 1
      while k < len(shape) and (not group or prod < size):
        group.append(int(shape[k]))
        prod *= int(shape[k])
        k += 1
      if prod != size:
        return np.asarray(self).reshape(shape)
      groups.append(tuple(group))
    if k != len(shape):
      return np.asarray(self).reshape(shape)
    return TensorView(self._reader, self._base_shape, self.dtype, self.name, self._perm, groups)

  def __getitem__(self, idx) -> np.ndarray:
    idx = idx if isinstance(idx, tuple) else (idx,)
    if any(i is Ellipsis for i in idx):
      e = idx.index(Ellipsis)
      idx = idx[:e] + (slice(None),) * (self.ndim - len(idx) + 1) + idx[e + 1:]
    idx = idx + (slice(None),) * (self.ndim - len(idx))
    if len(idx) != self.ndim or not all(isinstance(i, (slice, int, np.integer)) for i in idx):
      return np.asarray(self)[idx]  # fancy indexing: read all, index in numpy
    ranges, squeeze = [], []
    for ax, (i, n) in enumerate(zip(idx, self.shape)):
      if isinstance(i, slice):
        start, stop, step = i.indices(n)
        if step != 1:
          return np.asarray(self)[idx]
        ranges.append((start, max(start, stop)))
      else:
        i = int(i) + (n if i < 0 else 0)
        if not 0 <= i < n:
          raise IndexError(f"index {i} is out of bounds for axis {ax} of {self!r}")
        ranges.append((i, i + 1))
        squeeze.append(ax)
    base_idx = [slice(None)] * len(self._base_shape)
    block_shape, post, k = [], [], 0
    for t, g in enumerate(self._split):
      inner = math.prod(g[1:])
      a0, a1 = ranges[k]
      base_idx[self._perm[t]] = slice(a0 * inner, a1 * inner)
      block_shape += [a1 - a0, *g[1:]]
      post += [slice(None)] + [slice(*ranges[k + j]) for j in range(1, len(g))]
      k += len(g)
    block = np.asarray(self._reader(tuple(base_idx)))
    block = block.transpose(self._perm).reshape(block_shape)[tuple(post)]
    return block.reshape(tuple(s for a, s in enumerate(block.shape) if a not in squeeze))

  def __array__(self, dtype=None, copy=None):
    a = self[()] if self.ndim else np.asarray(self._reader(())).reshape(())
    return a if dtype is None else a.astype(dtype)


class SafetensorsFile:
  """One `.safetensors` file opened with the `safetensors` package: `f[name]` is a `TensorView`."""

  def __init__(self, path: str):
    self.path = path
    if not os.path.isfile(path):
      raise FileNotFoundError(f"safetensors file not found: {path}")
    try:
      self._f = safe_open(path, framework="numpy")
    except SafetensorError as e:  # truncated file, malformed header, offsets out of range
      raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
    self.metadata = self._f.metadata() or {}
    self._entries = {}
    for name in self._f.keys():
      sl = self._f.get_slice(name)
      dt = sl.get_dtype()
      if dt not in _DTYPES:
        raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {dt!r}")
      self._entries[name] = (tuple(sl.get_shape()), _DTYPES[dt])

  def keys(self):
    return self._entries.keys()

  def __contains__(self, name):
    return name in self._entries

  def shape(self, name):
    return self._entries[name][0]

  def _reader(self, name):
    def read(idx):
      if not idx or all(i == slice(None) for i in idx):
        return self._f.get_tensor(name)
      return self._f.get_slice(name)[idx]
    return read

  def __getitem__(self, name) -> TensorView:
    if name not in self._entries:
      raise KeyError(f"{self.path}: no tensor named {name!r}")
    shape, dtype = self._entries[name]
    return TensorView(self._reader(name), shape, dtype, name)


def save_file(tensors: dict[str, np.ndarray], path: str, metadata: dict | None = None):
  """Writes tensors (numpy arrays, bfloat16 allowed) in the safetensors format, atomically."""
  arrays = {}
  for name, a in tensors.items():
    a = np.asarray(a, order="C")  # (np.ascontiguousarray would turn a scalar into shape [1])
    if a.dtype not in _STORABLE:
      raise ValueError(f"tensor {name!r}: dtype {a.dtype} cannot be stored in safetensors")
    arrays[name] = a
  meta = {"format": "pt", **{str(k): str(v) for k, v in (metadata or {}).items()}}
  tmp = path + ".tmp"
  st_numpy.save_file(arrays, tmp, metadata=meta)
  os.replace(tmp, path)
