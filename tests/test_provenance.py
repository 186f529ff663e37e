"""`trace_jax.provenance`: the environment a run records and the fingerprints of its arrays."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.provenance import environment, fingerprint, tree_fingerprint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


# The data of both worlds (the default variant's and `lessons`) and of the tool tasks at 2,000
# traces, as committed:
# any change to the world generators, the expert, the prompts, the tokenizer or the packing moves
# them (then regenerate with tests/scripts/data_fingerprints.py and say why in the commit); a
# machine must never move them.
WORLD_DATA = {
    None: {"world": "80a8526a707a", "traces": "85158aced3fe", "sft_rows": 1117,
           "sft_data": "63063f8e85f1"},
    "lessons": {"world": "a12167acf8c5", "traces": "9620f9b1c555", "sft_rows": 746,
                "sft_data": "200cc7587eb4"},
    "math": {"world": "249bc5eb0bed", "traces": "e9b787b640dd", "sft_rows": 666,
             "sft_data": "6496dd637d09"},
    "fc": {"world": "0f8943b05802", "traces": "2ff2fa2f57d0", "sft_rows": 879,
           "sft_data": "202231874a4a"},
}


def _data_fingerprints(tmp_path, extra_env=None, variant=None) -> dict:
  """`variant`: None (the default world), "lessons", or a tool task ("math", "fc")."""
  cmd = [sys.executable, os.path.join(ROOT, "tests", "scripts", "data_fingerprints.py"),
         "--cache", str(tmp_path), "--traces", "2000"]
  cmd += (["--task", variant] if variant in ("math", "fc") else
          ["--variant", variant] if variant else [])
  env = dict(os.environ, **(extra_env or {}))
  out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def _vector_paths_off() -> dict:
  """NPY_DISABLE_CPU_FEATURES naming every vector extension numpy dispatches to on this machine:
  numpy then runs its baseline code (its sorts and partitions order ties differently there)."""
  try:
    from numpy._core import _multiarray_umath as m
  except ImportError:  # numpy 1.x
    from numpy.core import _multiarray_umath as m
  found = [f for f in m.__cpu_dispatch__ if m.__cpu_features__.get(f)]
  return {"NPY_DISABLE_CPU_FEATURES": " ".join(found)}


@pytest.mark.parametrize("variant", [None, "lessons", "math", "fc"])
def test_world_data_is_the_same_on_every_machine(tmp_path, variant):
  """The world, its expert traces and the packed warm-start rows equal the committed
  fingerprints, with and without numpy's vector code (a world whose retrieval broke score ties
  by a CPU-dependent partition once gave two machines different warm starts)."""
  assert _data_fingerprints(tmp_path / "a", variant=variant) == WORLD_DATA[variant]
  assert _data_fingerprints(tmp_path / "b", _vector_paths_off(), variant) == WORLD_DATA[variant]
