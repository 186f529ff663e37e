"""The RL update on mesh (2,2,2) of 8 fake CPU devices, in a fresh interpreter."""

from devices import run_on_devices


def test_update_on_mesh_2x2x2_keeps_rows_split_and_matches_one_device():
  res = run_on_devices("sharded_step.py", "--mode", "update")
  # 16 rows / (data 2 x fsdp 2) / 2 micro-batches: every attention matmul of the compiled update
  # multiplies 2 rows per device.
  assert res["expected_rows_per_device"] == 2
  assert res["attention_rows_per_device"] == [2]
  # Loss, gradients and the step itself match one device.
  assert abs(res["loss_1"] - res["loss_8"]) < 1e-5
  assert res["max_grad_diff"] < 1e-5
  assert res["max_param_diff_after_step"] < 1e-4 and res["skipped_8"] == 0.0
  # The state comes back in the shardings it went in with (parameters, masters and moments really
  # split), and a second step reuses the compiled program.
  assert res["out_shardings_equal"] and res["sharded_leaves"] >= res["n_state_leaves"] // 3
  assert res["cache_size_1"] == 1 and res["cache_size_2"] == 1
  # Reference log-probs: micro-batched on device, split over the rows like the batch.
  assert res["ref_sharding_ok"] and res["ref_max_diff"] < 1e-5
