"""The comparison `benchmarks/pool_preemption.py` makes between an ample and a tight pool's run."""

import math

from benchmarks.pool_preemption import compare


def test_compare_tells_rounding_from_a_difference():
  ample = [{"step": 1, "reward_mean": 0.5, "loss": 0.123456789, "approx_kl": 4e-14,
            "generated_tokens_total": 100, "sampler_preemptions": 0, "ledger_decode_steps": 10,
            "slice_auc": math.nan, "update_seconds": 1.0}]
  tight = [{"step": 1, "reward_mean": 0.5, "loss": 0.123456790, "approx_kl": 4.4e-14,
            "generated_tokens_total": 100, "sampler_preemptions": 3, "ledger_decode_steps": 17,
            "slice_auc": math.nan, "update_seconds": 2.0}]
  out = compare(ample, tight)
  assert out["different"] == [] and out["equal"] == 4 and out["rounding"] == 2
  assert 0 < out["max_relative"] < 1e-7  # the loss; the KL is noise below the floor
  assert compare(ample, tight)["records"] == [1, 1]
  tight[0]["generated_tokens_total"] = 101  # a token more: never rounding
  tight[0]["loss"] = 0.1235
  keys = sorted(d["key"] for d in compare(ample, tight)["different"])
  assert keys == ["generated_tokens_total", "loss"]
  assert compare(ample, tight + tight)["different"][-1]["key"] == "records"


def test_array_difference_is_relative_to_each_arrays_magnitude():
  import numpy as np

  from trace_jax.record_compare import array_difference
  a = [np.ones((2, 3), np.float32) * 10, np.zeros(4, np.float32)]
  assert array_difference(a, [x.copy() for x in a]) == 0.0
  b = [a[0] + np.float32(1e-5), a[1]]
  assert 5e-7 < array_difference(b, a) < 2e-6  # 1e-5 against a largest magnitude of 10
  assert array_difference(a, a[:1]) == float("inf")
  assert array_difference([np.ones(3)], [np.ones(4)]) == float("inf")
