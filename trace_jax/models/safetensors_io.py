"""Minimal safetensors reader/writer on numpy memory maps.

Reading through `np.memmap` lets a loader slice one shard of a tensor without touching the rest of
the file, so a large checkpoint is never materialized whole in host or device memory. bfloat16 is
handled through `ml_dtypes` (plain numpy has no bfloat16).
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


class SafetensorsFile:
  """Lazy view of one `.safetensors` file: `f[name]` is a read-only memory-mapped array."""

  def __init__(self, path: str):
    self.path = path
    if not os.path.isfile(path):
      raise FileNotFoundError(f"safetensors file not found: {path}")
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
      raw = fh.read(8)
      if len(raw) < 8:
        raise ValueError(f"{path}: truncated safetensors file (no header length)")
      (n,) = struct.unpack("<Q", raw)
      if n > size - 8:
        raise ValueError(f"{path}: header length {n} exceeds the file size {size}")
      try:
        header = json.loads(fh.read(n))
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}: malformed safetensors header: {e}") from None
    self.metadata = header.pop("__metadata__", {}) or {}
    self._data_start = 8 + n
    self._entries = header
    for name, e in header.items():
      if e.get("dtype") not in _DTYPES:
        raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {e.get('dtype')!r}")
      b, end = e["data_offsets"]
      want = int(np.prod(e["shape"], dtype=np.int64)) * np.dtype(_DTYPES[e["dtype"]]).itemsize
      if end - b != want or self._data_start + end > size:
        raise ValueError(f"{path}: tensor {name!r} has inconsistent offsets {e['data_offsets']} "
                         f"for shape {e['shape']} (file truncated?)")
    self._mm = None

  def keys(self):
    return self._entries.keys()

  def __contains__(self, name):
    return name in self._entries

  def shape(self, name):
    return tuple(self._entries[name]["shape"])

  def __getitem__(self, name) -> np.ndarray:
    if name not in self._entries:
      raise KeyError(f"{self.path}: no tensor named {name!r}")
    if self._mm is None:
      self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
    e = self._entries[name]
    b, end = e["data_offsets"]
    buf = self._mm[self._data_start + b:self._data_start + end]
    return buf.view(_DTYPES[e["dtype"]]).reshape(e["shape"])


def save_file(tensors: dict[str, np.ndarray], path: str, metadata: dict | None = None):
  """Writes tensors (numpy arrays, bfloat16 allowed) in the safetensors format."""
  header, offset, arrays = {}, 0, []
  for name in sorted(tensors):
    a = np.ascontiguousarray(tensors[name])
    if a.dtype not in _NAMES:
      raise ValueError(f"tensor {name!r}: dtype {a.dtype} cannot be stored in safetensors")
    header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape),
                    "data_offsets": [offset, offset + a.nbytes]}
    offset += a.nbytes
    arrays.append(a)
  header["__metadata__"] = {"format": "pt", **(metadata or {})}
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # the format aligns the data section to 8 bytes
  tmp = path + ".tmp"
  with open(tmp, "wb") as fh:
    fh.write(struct.pack("<Q", len(blob)))
    fh.write(blob)
    for a in arrays:
      fh.write(a.tobytes())
  os.replace(tmp, path)
