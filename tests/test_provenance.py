"""`trace_jax.provenance`: the environment a run records and the fingerprints of its arrays."""

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.provenance import environment, fingerprint, tree_fingerprint


def test_environment_names_versions():
  env = environment()
  assert env["packages"]["jax"] == jax.__version__ and env["packages"]["numpy"] == np.__version__
  assert env["cpu_count"] >= 1 and env["python"].count(".") == 2 and env["platform"]
  assert environment(packages=("no-such-package-here",))["packages"] == {
      "no-such-package-here": None}


def test_fingerprint_tells_bytes_dtype_and_shape_apart():
  a = np.arange(6, dtype=np.int32)
  assert fingerprint(a) == fingerprint(a.copy()) and len(fingerprint(a)) == 12
  assert fingerprint(a) != fingerprint(a.astype(np.int64))  # same values, other dtype
  assert fingerprint(a) != fingerprint(a.reshape(2, 3))  # same bytes, other shape
  b = a.copy()
  b[5] = 7
  assert fingerprint(a) != fingerprint(b)
  assert fingerprint(a, b) != fingerprint(b, a)  # order counts
  assert fingerprint(a.reshape(2, 3).T) == fingerprint(np.ascontiguousarray(a.reshape(2, 3).T))


def test_tree_fingerprint():
  tree = {"w": jnp.ones((2, 3), jnp.float32), "b": jnp.zeros((3,), jnp.bfloat16)}
  leaves = [np.asarray(x) for x in jax.tree.leaves(tree)]
  assert tree_fingerprint(tree) == fingerprint(*leaves)
  moved = jax.tree.map(lambda x: x.at[0].add(1), tree)
  assert tree_fingerprint(moved) != tree_fingerprint(tree)
