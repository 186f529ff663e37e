"""Sharding on 8 fake CPU devices and a two-process run, each in a fresh interpreter."""

import os
import socket
import subprocess
import sys

import pytest
from jax.sharding import PartitionSpec as P

from devices import device_env, last_json
from trace_jax.parallel import logical_to_spec, make_mesh, parse_mesh_spec

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "sharded_step.py")


_env, _last_json = device_env, last_json


def test_mesh_2x2x2_forward_loss_grad_equal_single_device():
  r = subprocess.run([sys.executable, SCRIPT, "--mode", "compare"], env=_env(8),
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  res = _last_json(r.stdout)
  assert abs(res["loss_1"] - res["loss_8"]) < 1e-5
  assert res["max_logit_diff"] < 1e-4
  assert res["max_grad_diff"] < 1e-5
  assert abs(res["gnorm_1"] - res["gnorm_8"]) < 1e-4 * res["gnorm_1"]
  assert any("tensor" in s or "fsdp" in s for s in res["specs"])  # really sharded
  assert res["load_sharded_ok"] and res["load_max_diff"] == 0.0  # HF import placed on the mesh


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_run_one_sharded_step_and_agree():
  port = _free_port()
  procs = [subprocess.Popen(
      [sys.executable, SCRIPT, "--mode", "multiprocess", "--coordinator", f"127.0.0.1:{port}",
       "--num_processes", "2", "--process_id", str(i)],
      env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
  outs = []
  for p in procs:
    try:
      out, err = p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
    assert p.returncode == 0, err[-3000:]
    outs.append(_last_json(out))
  assert sorted(o["process"] for o in outs) == [0, 1]
  assert all(o["devices"] == 4 for o in outs)
  assert outs[0]["loss"] == pytest.approx(outs[1]["loss"], abs=1e-6)
  assert outs[0]["logit_sum"] == pytest.approx(outs[1]["logit_sum"], rel=1e-6)


def test_mesh_errors_name_the_axes():
  with pytest.raises(ValueError, match="unknown mesh axis 'model'"):
    parse_mesh_spec("data:2,model:4")
  with pytest.raises(ValueError, match="need 16 devices"):
    make_mesh("data:2,fsdp:4,tensor:2")
  with pytest.raises(KeyError, match="no sharding rule"):
    logical_to_spec(("embed", "nonsense"))


def test_logical_rules_map_to_mesh_axes():
  assert logical_to_spec(("embed", "mlp")) == P("fsdp", "tensor")
  assert logical_to_spec(("batch", None)) == P(("data", "fsdp"))
  assert logical_to_spec(("vocab", "embed")) == P("tensor", "fsdp")


def test_micro_batch_split_without_mesh_is_a_plain_reshape_and_merge_inverts_it():
  import numpy as np
  from trace_jax.parallel import merge_micro_batches, row_shards, split_micro_batches
  x = {"a": np.arange(24).reshape(8, 3), "b": np.arange(8)}
  mbs = split_micro_batches(x, 4)
  assert row_shards(None) == 1
  np.testing.assert_array_equal(mbs["a"], x["a"].reshape(4, 2, 3))
  back = merge_micro_batches(mbs)
  np.testing.assert_array_equal(back["a"], x["a"])
  np.testing.assert_array_equal(back["b"], x["b"])
  with pytest.raises(ValueError, match="micro_batches=3"):
    split_micro_batches(x, 3)
