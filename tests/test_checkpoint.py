import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from trace_jax.checkpoint import Checkpointer, abstract_like
from trace_jax.models.qwen3 import Qwen3, get_preset
from trace_jax.parallel import make_mesh


def _state(seed):
  model = Qwen3(get_preset("tiny", vocab_size=50, num_layers=1), rngs=nnx.Rngs(seed))
  params = nnx.state(model, nnx.Param)
  opt = optax.adamw(1e-3).init(params)
  return {"params": params, "opt": opt, "step": jnp.asarray(seed, jnp.int32),
          "rng": jax.random.key_data(jax.random.key(seed))}


def test_save_restore_round_trip_with_metadata(tmp_path):
  ck = Checkpointer(str(tmp_path / "ckpt"), max_to_keep=2)
  assert ck.latest_step() is None
  for step in (1, 2, 3):
    ck.save(step, _state(step), {"step": step, "world": "seed0", "acc": np.float32(0.5)})
  assert ck.all_steps() == [2, 3]
  target = _state(0)
  restored, meta = ck.restore(target)
  want = _state(3)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert meta == {"step": 3, "world": "seed0", "acc": 0.5}
  restored2, _ = ck.restore(target, step=2)
  assert int(restored2["step"]) == 2


def test_restore_into_target_sharding(tmp_path):
  ck = Checkpointer(str(tmp_path / "ck"))
  x = {"w": jnp.arange(16.0).reshape(4, 4)}
  ck.save(0, x)
  mesh = make_mesh("data:1,fsdp:1,tensor:1")
  sh = {"w": NamedSharding(mesh, P(None, "tensor"))}
  out, meta = ck.restore(abstract_like(x, sh))
  assert out["w"].sharding == sh["w"]
  np.testing.assert_array_equal(np.asarray(out["w"]), np.asarray(x["w"]))
  assert meta == {}


def test_missing_checkpoint_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="no checkpoint"):
    Checkpointer(str(tmp_path / "none")).restore({"w": jnp.zeros(2)})
