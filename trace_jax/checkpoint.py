"""Orbax checkpoints of a training state pytree plus JSON host metadata.

A training state is any pytree of arrays (params, optimizer states, step, rng key data). Restoring
takes an abstract target (`jax.ShapeDtypeStruct`s with shardings, e.g. from `abstract_like`) so the
arrays come back directly in their target sharding, on any mesh.
"""

from __future__ import annotations

import base64
import collections
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


def abstract_like(tree, shardings=None):
  """ShapeDtypeStructs of a pytree, with the given shardings (a matching pytree) or the arrays'."""
  if shardings is None:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                       sharding=getattr(x, "sharding", None)), tree)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                      shardings)


class Checkpointer:
  """Keeps the last `max_to_keep` checkpoints of (state, metadata) under `directory`."""

  def __init__(self, directory: str, max_to_keep: int = 3, save_interval_steps: int = 1):
    self.directory = os.path.abspath(directory)
    opts = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                        save_interval_steps=save_interval_steps, create=True)
    self._mgr = ocp.CheckpointManager(self.directory, options=opts,
                                      item_names=("state", "metadata"))

  def latest_step(self) -> int | None:
    return self._mgr.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._mgr.all_steps())

  def save(self, step: int, state: Any, metadata: dict | None = None, force: bool = False) -> bool:
    saved = self._mgr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        metadata=ocp.args.JsonSave(jsonable(metadata or {}))), force=force)
    self._mgr.wait_until_finished()
    return saved

  def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict]:
    """target: a pytree of arrays or ShapeDtypeStructs (with shardings) shaped like the state."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint found under {self.directory}")
    abstract = jax.tree.map(
        lambda x: x if isinstance(x, jax.ShapeDtypeStruct) else jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=getattr(x, "sharding", None)), target)
    out = self._mgr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), metadata=ocp.args.JsonRestore()))
    return out["state"], dict(out["metadata"] or {})

  def close(self):
    self._mgr.close()


def jsonable(x):
  """numpy scalars and arrays (also nested in dicts and lists) as plain JSON values."""
  if isinstance(x, dict):
    return {str(k): jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [jsonable(v) for v in x]
  if isinstance(x, (np.integer,)):
    return int(x)
  if isinstance(x, (np.floating,)):
    return float(x)
  if isinstance(x, np.ndarray):
    return x.tolist()
  return x


def encode_host(x):
  """Host state (nested dicts, lists, tuples and deques of numpy arrays and scalars) as JSON
  values, arrays bit-exact (base64 of their bytes), for a checkpoint's metadata."""
  if isinstance(x, np.ndarray):
    return {"__ndarray__": base64.b64encode(np.ascontiguousarray(x).tobytes()).decode("ascii"),
            "dtype": x.dtype.str, "shape": list(x.shape)}
  if isinstance(x, dict):
    return {str(k): encode_host(v) for k, v in x.items()}
  if isinstance(x, (list, tuple, collections.deque)):
    return [encode_host(v) for v in x]
  return jsonable(x)


def decode_host(x):
  """Inverse of `encode_host` (tuples and deques come back as lists)."""
  if isinstance(x, dict):
    if "__ndarray__" in x:
      raw = base64.b64decode(x["__ndarray__"])
      return np.frombuffer(raw, dtype=np.dtype(x["dtype"])).reshape(x["shape"]).copy()
    return {k: decode_host(v) for k, v in x.items()}
  if isinstance(x, list):
    return [decode_host(v) for v in x]
  return x
