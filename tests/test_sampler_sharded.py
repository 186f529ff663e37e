"""The sampler engine on mesh (data 2, fsdp 2, tensor 2) of 8 fake CPU devices, in a fresh
interpreter: the same greedy trees as one device, the pool split as designed, no pool gather."""

from devices import run_on_devices


def test_engine_on_mesh_2x2x2_matches_one_device_and_keeps_the_pool_split():
  res = run_on_devices("sampler_mesh.py", timeout=900)
  # Greedy trees (stage 1 and forks at depths 0-2) token-identical to the single-device engine,
  # and log-probs and features equal to a plain forward.
  assert res["same_tokens_as_one_device"] and res["forks"] >= 9
  assert res["oracle"]["tokens"] > 400 and res["oracle"]["features"] > 40
  assert res["plain_same_tokens"]
  # Pages over (data, fsdp), KV heads over tensor, before and after decoding: each device holds
  # 512 / 4 pages of 1 of the 2 KV heads.
  spec = ["('data', 'fsdp')", "None", "tensor", "None"]
  assert res["pool_spec_before"] == spec and res["pool_spec_after"] == spec
  assert res["pool_shard_shape"] == [128, 4, 1, 32]
  # Sampling weights: tensor-parallel, never split over data or fsdp.
  assert all("data" not in s and "fsdp" not in s for s in res["weight_specs"])
  assert any("tensor" in s for s in res["weight_specs"])
  # Sampled tokens come back split over the data shards; every tree on one shard.
  assert res["out_spec"] == ["('data', 'fsdp')"]
  assert res["trees_on_one_shard"] and len(set(res["tree_shards"])) == 3
  # The compiled decode gathers no pool array (only per-slot scalars and logits rows).
  assert res["pool_all_gathers"] == []
  assert all("[512," not in s and "[128," not in s for s in res["all_gather_shapes"])
  assert res["released_all"] and not res["recompiled"]
  # Prompt scoring runs on the sampler's mesh, rows split over the data shards, and gives the
  # single-device features.
  assert res["features_spec"] == ["('data', 'fsdp')"] and res["features_shape"] == [6, 128]
  assert res["features_max_abs_vs_one_device"] < 1e-4
  # The pool scored with keep on the mesh: the same features, the trees sampled from the kept
  # pages with the single device's tokens, and every page back after release.
  assert res["kept_features_max_abs_vs_one_device"] < 1e-4 and res["kept_same_tokens"]
  assert res["kept_trees_on_their_pages_shard"] and res["kept_released_all"]
  # Rollouts started ahead on the mesh and adopted by the next run: the single device's tokens.
  assert res["ahead_started"] > 0 and res["ahead_same_tokens"]
  assert res["ahead_trees_on_one_shard"] and res["ahead_released_all"]
