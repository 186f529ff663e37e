"""The logic of `benchmarks/chaos.py`'s two-process and quarter-pool kinds and of
`benchmarks/soak.py`: the slope fit and its verdict, the kinds a trial draws, the metrics a smaller
pool may change, the pool a quarter-pool trial gets, the bound on a killed process's survivor, and a
short soak of the real engine."""

import collections
import json
import random
import subprocess
import sys
import time

import numpy as np
import pytest

from benchmarks import chaos, soak


# ---- soak: slope fit and verdict ----------------------------------------------------------------
def test_fit_slope_recovers_a_known_line():
  x = np.arange(0, 20000, 100)
  rng = np.random.default_rng(0)
  y = 5e8 + 0.25 * x + rng.normal(0, 1000.0, x.size)  # 250 bytes per 1000 steps, noisy
  fit = soak.fit_slope(x, y)
  slope, intercept = np.polyfit(x, y, 1)  # the least-squares line
  assert fit["slope_per_1k"] == pytest.approx(1000 * slope, rel=1e-9)
  assert fit["intercept"] == pytest.approx(intercept, rel=1e-9)
  assert fit["slope_per_1k"] == pytest.approx(250.0, abs=4 * fit["slope_se_per_1k"])
  assert 0 < fit["slope_se_per_1k"] < 20 and fit["resid_std"] == pytest.approx(1000, rel=0.2)
  assert fit["span_steps"] == x[-1] and fit["samples"] == x.size
  with pytest.raises(ValueError, match="at least 3"):
    soak.fit_slope([0, 1], [1, 2])


def test_verdict_tells_noise_from_growth():
  x = np.arange(0, 10000, 100)
  rng = np.random.default_rng(1)
  noise = 1e8 + rng.normal(0, 2e5, x.size)  # 0.2% noise, no trend
  assert soak.is_flat(soak.fit_slope(x, noise))["flat"]
  # 40 MB over the span: far past 3 sigma of the noise and past 0.5% of the mean
  leak = noise + 4000.0 * x
  v = soak.is_flat(soak.fit_slope(x, leak))
  assert not v["flat"] and v["growth_over_span"] > v["bound"]
  # a constant series (device bytes with nothing leaking) is flat; one more array per 1000 steps
  # is caught by the relative floor only when it grows past 0.5% over the span
  const = np.full(x.size, 5e6)
  assert soak.is_flat(soak.fit_slope(x, const))["flat"]
  assert not soak.is_flat(soak.fit_slope(x, const + 10.0 * x))["flat"]  # +99 kB = 2% of 5 MB


def _samples(rss, dev, pages, steps):
  return [dict(decode_steps=int(s), rss_bytes=float(r), device_bytes=float(d), free_pages=p,
               between_rounds=True) for s, r, d, p in zip(steps, rss, dev, pages)]


def test_analyse_leaves_out_the_warmup_and_catches_a_page_leak():
  steps = np.arange(0, 10001, 100)
  # compilation and allocator pools in the first 10%: a big jump, flat afterwards
  rss = np.where(steps < 1000, 3e8 + 1e5 * steps, 4.5e8)
  dev = np.where(steps < 500, 5e6, 8e6)
  pages = [511] * steps.size
  v = soak.analyse(_samples(rss, dev, pages, steps), warmup=0.2)
  assert v["flat"] and v["warmup_decode_steps"] == 2000 and v["samples_fitted"] == 81
  assert v["rss_bytes"]["slope_per_1k"] == pytest.approx(0.0, abs=1e-3)
  # fitting from the start sees the warm-up's jump as growth
  assert not soak.analyse(_samples(rss, dev, pages, steps), warmup=0.0)["flat"]
  # a page not returned between rounds fails the soak even with flat memory
  leaky = [511] * 50 + [510] * (steps.size - 50)
  v = soak.analyse(_samples(rss, dev, leaky, steps), warmup=0.2)
  assert not v["flat"] and v["free_pages_between_rounds"] == [510, 511]


def test_a_short_soak_of_the_engine(tmp_path):
  soak.main(["--decode_steps=150", "--every=20", f"--out={tmp_path / 'soak'}"])
  r = json.loads((tmp_path / "soak.json").read_text())
  assert (tmp_path / "soak.png").stat().st_size > 0
  assert r["decode_steps"] >= 150 and r["rounds"] >= 2
  s = r["samples"]
  assert s[0]["decode_steps"] == 0 and s[-1]["decode_steps"] == r["decode_steps"]
  assert all(b["decode_steps"] > a["decode_steps"] for a, b in zip(s, s[1:]))
  assert all(x["rss_bytes"] > 0 and x["device_bytes"] > 0 for x in s)
  v = r["verdict"]
  assert v["pages_returned"] and len(v["free_pages_between_rounds"]) == 1
  assert {"rss_bytes", "device_bytes"} <= set(v) and "|slope| x span" in r["rule"]


# ---- chaos: kinds, comparison, pool, survivors --------------------------------------------------
def test_a_two_process_trial_draws_only_the_kinds_it_takes():
  rnd = random.Random(0)
  seen, pair_trials = collections.Counter(), 0
  for _ in range(400):
    kinds = chaos.draw_kinds(rnd, chaos.KINDS, 5)
    assert len(kinds) == 5 and set(kinds) <= set(chaos.KINDS)
    seen.update(kinds)
    if "kill_one_of_two" in kinds:
      pair_trials += 1
      assert set(kinds) <= set(chaos.PAIR_KINDS), kinds
  assert set(seen) == set(chaos.KINDS)  # every kind is drawn, the new ones included
  assert 0 < pair_trials < 400
  # without a two-process kind, the draw is the plain draw
  a, b = random.Random(3), random.Random(3)
  single = tuple(k for k in chaos.KINDS if k not in chaos.PAIR_FAULTS)
  assert chaos.draw_kinds(a, single, 6) == [b.choice(single) for _ in range(6)]
  # --kinds=kill_one_of_two: every fault of every trial is one
  assert chaos.draw_kinds(random.Random(1), ("kill_one_of_two",), 4) == ["kill_one_of_two"] * 4


def test_a_quarter_pool_is_compared_without_what_the_pool_changes():
  ref = [dict(step=1, reward_mean=0.5, loss=0.1, grad_norm=2.0, ledger_generated_tokens=100,
              ledger_prefill_tokens=40, prefill_tokens=40, slice_prefill_tokens=7,
              ledger_decode_steps=30, ledger_preemptions=0, sampler_peak_pages=60)]
  small = [dict(ref[0], ledger_prefill_tokens=40, slice_prefill_tokens=9, ledger_decode_steps=55,
                ledger_preemptions=4, sampler_peak_pages=15)]
  assert chaos.first_difference(chaos.comparable(small, True), chaos.comparable(ref, True)) is None
  d = chaos.first_difference(chaos.comparable(small, False), chaos.comparable(ref, False))
  assert d["keys"] == ["ledger_decode_steps", "ledger_preemptions", "sampler_peak_pages",
                       "slice_prefill_tokens"]
  for key, value in (("reward_mean", 0.25), ("loss", 0.2), ("grad_norm", 2.5),
                     ("ledger_generated_tokens", 99)):
    moved = [dict(small[0], **{key: value})]
    d = chaos.first_difference(chaos.comparable(moved, True), chaos.comparable(ref, True))
    assert d == dict(step=1, keys=[key])
  assert chaos.first_difference(ref + ref, ref) == dict(records=2, reference_records=1)
  # a NaN in both is no difference (json gives every NaN as one object, the lists compare equal)
  nan = [dict(step=0, probe_success=float("nan"), probe_bce=1e-7)]
  off = [dict(step=0, probe_success=float("nan"), probe_bce=1.0000001e-7)]
  assert chaos.first_difference(nan, [dict(nan[0])]) is None
  assert chaos.first_difference(off, nan) == dict(step=0, keys=["probe_bce"])
  rel = chaos.largest_relative_difference(off + small, nan + ref)
  assert list(rel) == ["ledger_decode_steps", "ledger_preemptions", "probe_bce",
                       "sampler_peak_pages", "slice_prefill_tokens"]
  assert rel["probe_bce"] == pytest.approx(1e-7, rel=1e-3) and rel["ledger_preemptions"] == 1.0


def test_the_quarter_pool_reads_the_reference_peak_else_its_configured_pool():
  recs = [dict(step=0), dict(step=1, sampler_peak_pages=130), dict(step=2, sampler_peak_pages=97)]
  p = chaos.quarter_pool(recs, 1024)
  assert p["pages"] == 33 and p["need"] == 130 and "sampler_peak_pages" in p["basis"]
  p = chaos.quarter_pool([dict(step=1, loss=0.1)], 1024)
  assert p["pages"] == 256 and p["need"] == 1024 and "configured" in p["basis"]


def _py(code):
  return [sys.executable, "-c", code]


def test_a_survivor_that_does_not_stop_is_killed_and_said_to_have_hung():
  t0 = time.time()
  hung = subprocess.Popen(_py("import time; time.sleep(60)"))
  r = chaos.stop_within(hung, 0.5)
  assert r["hung"] and r["exit"] == -9 and time.time() - t0 < 10
  r = chaos.stop_within(subprocess.Popen(_py("raise SystemExit(3)")), 30)
  assert not r["hung"] and r["exit"] == 3


def test_an_attempt_bounds_the_peer_of_a_failed_process():
  code = ("import os, sys, time\n"
          "if os.environ['ROLE'] == 'dies': sys.exit(2)\n"
          "time.sleep(60)\n")
  t0 = time.time()
  att = chaos.Attempt(_py(code), [dict(chaos.os.environ, ROLE="dies"),
                                  dict(chaos.os.environ, ROLE="hangs")])
  assert att.finish(timeout=120, bound_s=0.5) == [2, -9]
  assert [k["process"] for k in att.killed_after_peer] == [1] and att.killed_after_peer[0]["hung"]
  assert not att.timed_out and time.time() - t0 < 15
  slow = chaos.Attempt(_py("import time; time.sleep(60)"), [dict(chaos.os.environ)])
  assert slow.finish(timeout=0.5, bound_s=30) == [-9] and slow.timed_out  # past the run's bound
  ok = chaos.Attempt(_py("print('done')"), [dict(chaos.os.environ)] * 2)
  assert ok.finish(timeout=60, bound_s=0.5) == [0, 0] and not ok.killed_after_peer
  assert ok.output(0).strip() == "done" and ok.output(1).strip() == "done"


def test_pair_env_and_resume_parsing():
  e = chaos.pair_env({"A": "1"}, 4321, 1, heartbeat_s=30, gather_s=120)
  assert e["TRACE_JAX_COORDINATOR"] == "127.0.0.1:4321" and e["TRACE_JAX_PROCESS_ID"] == "1"
  assert e["TRACE_JAX_NUM_PROCESSES"] == "2" and e["TRACE_JAX_HEARTBEAT_TIMEOUT"] == "30"
  assert e["TRACE_JAX_GATHER_TIMEOUT"] == "120" and e["A"] == "1"
  assert chaos.resumed_at("x\n[trace_jax] resumed at step 3 from /w/checkpoints\n") == 3
  assert chaos.resumed_at("no checkpoint") is None
