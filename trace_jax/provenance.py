"""Where a run's numbers came from: the machine and package versions, and fingerprints of arrays.

Two runs of the same commit and config are bit-identical on one machine, yet a fresh machine can
train a different warm start from the same synthetic world (one packed row more or fewer, another
step-0 loss): something outside the repository's code (a library's version, the platform) moved.
A campaign that mixes runs from two warm starts in one table compares unequal starts. So a run
records `environment()` in its summary and the warm start records `tree_fingerprint` of its
parameters (and of its packed training data); `launch/compare.py` names the warm starts its table
mixes. No jax at import.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys

import numpy as np

PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "tokenizers", "bm25s",
            "ml-collections")


def _cpu_model() -> str | None:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or None


def environment(packages=PACKAGES) -> dict:
  """Python, platform, CPU model and count, and the installed versions of `packages` (None for a
  package that is not installed)."""
  from importlib import metadata

  versions = {}
  for name in packages:
    try:
      versions[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      versions[name] = None
  return dict(python=sys.version.split()[0], platform=platform.platform(), cpu=_cpu_model(),
              cpu_count=os.cpu_count(), packages=versions)


def fingerprint(*arrays) -> str:
  """sha1 (12 hex digits) over the arrays' dtypes, shapes and bytes, in order."""
  h = hashlib.sha1()
  for a in arrays:
    a = np.ascontiguousarray(np.asarray(a))
    h.update(f"{a.dtype.str}{a.shape}".encode())
    h.update(a.tobytes())
  return h.hexdigest()[:12]


def text_fingerprint(texts) -> str:
  """sha1 (12 hex digits) over an iterable of strings, each ended by a NUL."""
  h = hashlib.sha1()
  for t in texts:
    h.update(t.encode("utf-8"))
    h.update(b"\0")
  return h.hexdigest()[:12]


def world_fingerprint(world) -> str:
  """`text_fingerprint` of a synthetic world: its passages (id and text, in corpus order) and its
  questions of both splits (id, question, answers, chain and relations)."""
  def texts():
    for d in world.corpus:
      yield d.id
      yield d.text
    for e in list(world.train) + list(world.test):
      yield e.id
      yield e.question
      yield "|".join(e.answers)
      yield "|".join(e.meta.get("chain", ()))
      yield "|".join(e.meta.get("relations", ()))
  return text_fingerprint(texts())


def tree_fingerprint(tree) -> str | None:
  """`fingerprint` of a pytree's leaves (fetched to the host), in the tree's leaf order; None when
  a leaf is not wholly on this process (a sharded array of several processes)."""
  import jax

  leaves = jax.tree.leaves(tree)
  if any(isinstance(x, jax.Array) and not x.is_fully_addressable for x in leaves):
    return None
  return fingerprint(*(np.asarray(jax.device_get(x)) for x in leaves))
