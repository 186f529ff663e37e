"""One short GPU check: tree-attention kernel correctness and speed, engine throughput.

Runs on whatever backend is present (on CPU the Pallas kernel runs in interpret mode) and writes
`$OUT/gpu_check.json` (else results/gpu_check.json) after every case, so a later failure or a
timeout keeps what was measured; every section and case records its error instead of stopping the
run. Sections, in priority order:

1. env: jax/jaxlib/plugin versions, devices, backend, nvidia-smi, Pallas Triton availability.
2. correctness: `tree_attention_pallas` (compiled; interpret on CPU) vs the jnp reference run in
   f32 at "highest" matmul precision, on random trees with ragged prefix/suffix lengths, empty
   groups, a slot without tokens, GQA groups 1/2/4/8, f32 and bf16, head_dim 32/64/128, several
   row blocks and key splits. f32 tolerance allows TF32 dots (Triton's default for f32).
3. kernel_speed: one decode step of one layer, B branches sharing a P-token prefix plus a private
   suffix each: Pallas tree kernel, jnp reference tree path, flat jnp paged attention over a pool
   where every branch holds its own copy of the prefix (the engine's non-tree path), and the same
   Pallas kernel run flat over that duplicated pool. All timed side by side (interleaved,
   median); effective bandwidth = bytes of KV the method must read / time.
4. sampler: the engine (`bench_sampler.engine_throughput`, tiny model, tree attention on vs off),
   then `bench_sampler.sharing_case` on a random-weight bf16 model (hidden 1024, 8 layers, head_dim
   128): tree vs duplicated prefix, decode tokens/s and KV bytes.
5. update (not in the default --sections; `--sections=update` alone on a device): one RL update
   step of a Qwen3-1.7B-shaped random bf16 model (f32 masters and Adam moments, per-layer remat,
   8 x 2048 tokens), its median step time and model-FLOP utilization against a bf16 matmul rate
   measured in the same run.
6. a PNG of kernel time and bandwidth per size, and a printed summary.

A wall-clock budget (--budget_s) skips remaining optional cases once spent, and a watchdog dumps
the stacks and exits if the run hangs past budget + 60 s.

  PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py 2>&1 | tee $OUT/log.txt   # GPU, ~3-4 min
  python3 benchmarks/gpu_check.py --quick                                      # CPU smoke, ~1.5 min
"""

from __future__ import annotations

import os
import sys
import time

T_START = time.perf_counter()  # before the jax import, so the total includes it

# Pallas on GPU: the kernel passes Triton CompilerParams (which pick the Triton lowering); if that
# import ever fails, compiler_params=None must still not pick Mosaic GPU. Set before jax loads.
os.environ.setdefault("JAX_PALLAS_USE_MOSAIC_GPU", "0")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import argparse  # noqa: E402
import faulthandler  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from trace_jax import kernels as ta  # noqa: E402
from trace_jax.diagnostics import CompileCounter  # noqa: E402
from trace_jax.kernels import gpu as gpu_kernel  # noqa: E402

H200_NOMINAL_GBPS = 4800.0
COMPILES = CompileCounter()  # XLA compilations (n) and their seconds (s), all script long
try:
  COMPILES.start()
except Exception:  # pragma: no cover - only counts compiles
  pass


def elapsed() -> float:
  return time.perf_counter() - T_START


def log(msg: str) -> None:
  print(f"[{elapsed():6.1f}s] {msg}", flush=True)


class Results:
  """The result dict, rewritten atomically to disk on every save()."""

  def __init__(self, path: str):
    self.path, self.data = path, {}

  def save(self) -> None:
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(self.data, f, indent=1, default=str)
    os.replace(tmp, self.path)


def _err(e: BaseException) -> dict:
  return {"error": f"{type(e).__name__}: {e}"[:2000],
          "traceback": traceback.format_exc()[-3000:]}


def run_section(res: Results, name: str, fn, *args) -> None:
  out = res.data.setdefault(name, {})
  c0, s0, t0 = COMPILES.n, COMPILES.s, time.perf_counter()
  log(f"== {name}")
  try:
    fn(out, res, *args)
  except Exception as e:
    out.update(_err(e))
    log(f"{name} FAILED: {out['error']}")
  out["wall_s"] = round(time.perf_counter() - t0, 2)
  out["compiles"] = COMPILES.n - c0
  out["compile_s"] = round(COMPILES.s - s0, 2)
  res.save()
  log(f"{name} done in {out['wall_s']:.1f}s ({out['compiles']} compiles, {out['compile_s']:.1f}s)")


def _block(x):
  return jax.block_until_ready(x)


# ---------------------------------------------------------------------------------------------
# 1. Environment
# ---------------------------------------------------------------------------------------------


def section_env(out, res, args):
  import importlib.metadata as md

  devs = jax.devices()
  out.update(
      python=sys.version.split()[0], platform=platform.platform(), cpu_count=os.cpu_count(),
      jax=jax.__version__, backend=jax.default_backend(), num_devices=len(devs),
      devices=[str(d) for d in devs], device_kind=devs[0].device_kind,
      quick=args.quick, interpret=args.interpret, budget_s=args.budget_s,
      pallas_triton_importable=gpu_kernel.pltriton is not None,
      JAX_PALLAS_USE_MOSAIC_GPU=os.environ.get("JAX_PALLAS_USE_MOSAIC_GPU"),
      attention_impl_auto=ta.resolve_impl("auto"),
  )
  try:
    import jaxlib
    out["jaxlib"] = getattr(jaxlib, "__version__", None) or jaxlib.version.__version__
  except Exception as e:
    out["jaxlib"] = repr(e)
  pkgs = {}
  for name in ("jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "jax-cuda12-pjrt",
               "flax", "optax", "numpy", "ml_dtypes", "matplotlib"):
    try:
      pkgs[name] = md.version(name)
    except Exception:
      pass
  out["packages"] = pkgs
  try:
    out["memory_stats_start"] = {k: v for k, v in (devs[0].memory_stats() or {}).items()
                                 if k in ("bytes_limit", "bytes_in_use", "peak_bytes_in_use")}
  except Exception:
    pass
  if out["backend"] == "gpu":
    try:
      smi = subprocess.run(
          ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,"
           "clocks.max.mem,power.limit", "--format=csv"],
          capture_output=True, text=True, timeout=20)
      out["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except Exception as e:
      out["nvidia_smi"] = repr(e)
  log(f"jax {out['jax']} jaxlib {out.get('jaxlib')} backend {out['backend']} "
      f"{out['device_kind']} x{len(devs)}; pallas triton: {out['pallas_triton_importable']}; "
      f"auto impl: {out['attention_impl_auto']}")


# ---------------------------------------------------------------------------------------------
# 2. Kernel correctness
# ---------------------------------------------------------------------------------------------

# f32 in the Triton kernel runs its dots in TF32 (default precision), ~1e-3 error on unit data.
TOL = {"float32": dict(atol=1e-2, rtol=1e-2), "bfloat16": dict(atol=3e-2, rtol=3e-2)}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# (name, dtype, head_dim, q_per_kv, kv heads, groups, branches per full group, prefix pages,
#  suffix pages, extra kernel kwargs). Page size 16 (the engine's). Table widths are deliberately
# not powers of two and lengths end mid-page.
CORRECTNESS_CASES = [
    ("f32_d64_g1", "float32", 64, 1, 2, 3, 3, 7, 5, {}),
    ("f32_d128_g4", "float32", 128, 4, 2, 2, 4, 9, 3, {}),
    ("f32_d32_g2_tinymodel", "float32", 32, 2, 2, 3, 8, 20, 6, {}),
    ("bf16_d64_g4", "bfloat16", 64, 4, 2, 3, 3, 7, 5, {}),
    ("bf16_d128_g8_rowblocks_splits", "bfloat16", 128, 8, 1, 2, 20, 70, 3, {}),
    ("bf16_d128_g1", "bfloat16", 128, 1, 4, 2, 5, 30, 19, {}),
    ("bf16_d128_g4_64br_5k", "bfloat16", 128, 4, 8, 1, 64, 320, 20, {}),
    ("bf16_d128_g8_split3_bk32", "bfloat16", 128, 8, 2, 3, 4, 13, 5,
     {"num_splits": 3, "block_k": 32}),
    ("f32_d128_g8_16br", "float32", 128, 8, 8, 2, 16, 40, 4, {}),
]


def random_tree(seed, *, dtype, head_dim, q_per_kv, num_kv_heads, num_groups, branches,
                prefix_pages, suffix_pages, page_size=16):
  """A random tree over a shuffled pool (numpy), with the edge cases the sampler produces.

  Group 0 has an empty prefix; the last group holds `branches` slots, the others 1..branches;
  some slots are in no group; the last slot has no tokens at all; lengths end mid-page; table
  padding points at live pages (a masking bug would show).
  """
  rng = np.random.default_rng(seed)
  ng, ps, hkv, d = num_groups, page_size, num_kv_heads, head_dim
  s = ng * branches + 2
  num_pages = ng * prefix_pages + s * suffix_pages + 1
  perm = rng.permutation(num_pages)
  k_pool = rng.standard_normal((num_pages, ps, hkv, d), dtype=np.float32)
  v_pool = rng.standard_normal((num_pages, ps, hkv, d), dtype=np.float32)
  group_pages = perm[: ng * prefix_pages].reshape(ng, prefix_pages).copy()
  suffix_tab = perm[ng * prefix_pages:][: s * suffix_pages].reshape(s, suffix_pages).copy()
  group_lens = rng.integers(1, prefix_pages * ps + 1, ng)
  group_lens[0] = 0
  if ng > 1:
    group_lens[-1] = prefix_pages * ps - int(rng.integers(1, ps))  # ragged, near full
  suffix_lens = rng.integers(0, suffix_pages * ps + 1, s)
  suffix_lens[-1] = 0
  group_slots = np.full((ng, branches), -1)
  order = rng.permutation(s - 1)  # the last slot stays out of every group
  pos = 0
  for g in range(ng):
    nb = branches if g == ng - 1 else int(rng.integers(1, branches + 1))
    take = order[pos: pos + nb]
    group_slots[g, : len(take)] = take
    pos += len(take)
  for tab, lens in ((group_pages, group_lens), (suffix_tab, suffix_lens)):
    for r in range(tab.shape[0]):
      used = -(-int(lens[r]) // ps)
      tab[r, used:] = rng.integers(0, num_pages, tab.shape[1] - used)
  q = rng.standard_normal((s, hkv * q_per_kv, d), dtype=np.float32)
  has_tokens = suffix_lens > 0
  for g in range(ng):
    for x in group_slots[g]:
      if x >= 0 and group_lens[g] > 0:
        has_tokens[x] = True
  floats = [q, k_pool, v_pool]
  ints = [np.asarray(a, np.int32) for a in (group_pages, group_lens, group_slots, suffix_tab,
                                            suffix_lens)]
  # Host-side casts (ml_dtypes), so building a case compiles nothing on the device.
  cast = [jnp.asarray(x.astype(jnp.dtype(DTYPES[dtype]))) for x in floats]
  ints = [jnp.asarray(x) for x in ints]
  # The f32 truth sees the same (possibly bf16-rounded) values as the kernel.
  f32 = [jnp.asarray(x.astype(jnp.dtype(DTYPES[dtype])).astype(np.float32)) for x in floats]
  return tuple(cast + ints), tuple(f32 + ints), has_tokens


def _highest_precision():
  """f32 dots at full precision (no TF32) for the truth; a no-op where the API is missing."""
  import contextlib

  ctx = getattr(jax, "default_matmul_precision", None)
  return ctx("highest") if ctx is not None else contextlib.nullcontext()


def section_correctness(out, res, args):
  cases = CORRECTNESS_CASES
  if args.quick:  # shrink: fewer pages, branches and heads; keep every dtype / D / G combination
    cases = [(n, dt, d, g, min(h, 2), ng, min(b, 5), min(pp, 6), min(sp, 4), kw)
             for (n, dt, d, g, h, ng, b, pp, sp, kw) in cases]
    cases = [c for c in cases if c[0] not in ("f32_d128_g8_16br", "bf16_d128_g1")]
  rows = out.setdefault("cases", [])
  for i, (name, dt, d, g, hkv, ng, br, pp, sp, kw) in enumerate(cases):
    if elapsed() > args.budget_s * 0.45 and i >= 4:
      rows.append({"case": name, "skipped": "time budget"})
      continue
    row = {"case": name, "dtype": dt, "head_dim": d, "q_per_kv": g, "num_kv_heads": hkv,
           "groups": ng, "branches": br, "prefix_pages": pp, "suffix_pages": sp, "kwargs": kw}
    t0 = time.perf_counter()
    try:
      targs, f32_args, has_tokens = random_tree(100 + i, dtype=dt, head_dim=d, q_per_kv=g,
                                      num_kv_heads=hkv, num_groups=ng, branches=br,
                                      prefix_pages=pp, suffix_pages=sp)
      row["num_slots"] = int(targs[0].shape[0])
      out_k = np.asarray(_block(ta.tree_attention_pallas(*targs, interpret=args.interpret, **kw)),
                         np.float32)
      out_r = np.asarray(_block(ta.tree_attention_reference(*targs)), np.float32)
      with _highest_precision():
        truth = np.asarray(_block(ta.tree_attention_reference(*f32_args)), np.float32)
      tol = TOL[dt]
      scale = float(np.abs(truth).max())
      err_k = float(np.abs(out_k - truth).max())
      err_r = float(np.abs(out_r - truth).max())
      ok_close = bool(np.all(np.abs(out_k - truth) <= tol["atol"] + tol["rtol"] * np.abs(truth)))
      finite = bool(np.isfinite(out_k).all())
      zeros_ok = bool(np.all(out_k[~has_tokens] == 0.0))
      row.update(max_abs_err_kernel=err_k, max_abs_err_reference=err_r, max_abs_truth=scale,
                 kernel_vs_reference=float(np.abs(out_k - out_r).max()), finite=finite,
                 empty_slots_zero=zeros_ok, tol=tol, passed=ok_close and finite and zeros_ok)
      log(f"  {name:34s} S={row['num_slots']:3d} max|err| kernel {err_k:.2e} ref {err_r:.2e} "
          f"-> {'PASS' if row['passed'] else 'FAIL'}")
    except Exception as e:
      row.update(_err(e), passed=False)
      log(f"  {name:34s} ERROR {row['error'][:300]}")
    row["wall_s"] = round(time.perf_counter() - t0, 2)
    rows.append(row)
    res.save()
  done = [r for r in rows if "passed" in r]
  out["passed"] = sum(r["passed"] for r in done)
  out["total"] = len(done)


# ---------------------------------------------------------------------------------------------
# 3. Kernel speed
# ---------------------------------------------------------------------------------------------


IMPLS = ("tree_pallas", "tree_ref", "flat_pallas", "flat_ref")


def build_speed_case(seed, prefix, branches, suffix, hq, hkv, d, ps, dtype):
  """Tree layout (prefix pages once) and duplicated layout (a copy per branch), on device."""
  assert prefix % ps == 0, "the duplicated layout assumes a page-aligned prefix"
  rng = np.random.default_rng(seed)
  pg, sp = prefix // ps, -(-suffix // ps)
  n_tree = pg + branches * sp
  kk, kv, kq = jax.random.split(jax.random.key(seed), 3)
  k_tree = jax.random.normal(kk, (n_tree, ps, hkv, d), dtype)
  v_tree = jax.random.normal(kv, (n_tree, ps, hkv, d), dtype)
  q = jax.random.normal(kq, (branches, hq, d), dtype)
  perm = rng.permutation(n_tree)
  prefix_ids, suffix_tab = perm[:pg], perm[pg:].reshape(branches, sp)
  i32 = lambda x: jnp.asarray(x, jnp.int32)
  tree_args = (q, k_tree, v_tree, i32(prefix_ids[None]), i32([prefix]),
               i32(np.arange(branches)[None]), i32(suffix_tab), i32(np.full(branches, suffix)))
  # Duplicated: branch b's table is (its copy of the prefix pages, its suffix pages), at shuffled
  # positions of a pool of branches * (pg + sp) pages.
  n_dup = branches * (pg + sp)
  src = np.concatenate([np.broadcast_to(prefix_ids, (branches, pg)), suffix_tab], axis=1)
  dtab = rng.permutation(n_dup).reshape(branches, pg + sp)
  pool_src = np.empty(n_dup, np.int64)
  pool_src[dtab.reshape(-1)] = src.reshape(-1)
  pool_src = i32(pool_src)
  k_dup, v_dup = k_tree[pool_src], v_tree[pool_src]
  dup_lens = i32(np.full(branches, prefix + suffix))
  flat_ref_args = (q, k_dup, v_dup, i32(dtab), dup_lens)
  # The same Pallas kernel without sharing: one empty group, every slot's table in the suffix.
  flat_pallas_args = (q, k_dup, v_dup, i32([[0]]), i32([0]), i32([[-1]]), i32(dtab), dup_lens)
  _block((k_dup, v_dup))
  return tree_args, flat_ref_args, flat_pallas_args, n_tree, n_dup


def time_pipelined(fns: dict, reps: int, target_s: float, warmup: int = 2) -> dict:
  """Per fn: `inner` calls dispatched back to back, then one block (amortizes dispatch); the
  fns interleaved over reps; median seconds per call. Also the blocked single-call latency."""
  for f in fns.values():
    for _ in range(warmup):
      _block(f())
  info = {}
  for name, f in fns.items():
    ts = []
    for _ in range(3):
      t0 = time.perf_counter()
      _block(f())
      ts.append(time.perf_counter() - t0)
    inner = int(min(100, max(1, round(target_s / max(min(ts), 1e-7)))))
    info[name] = {"inner": inner, "single_call_s": statistics.median(ts), "times": []}
  for _ in range(reps):
    for name, f in fns.items():
      k = info[name]["inner"]
      t0 = time.perf_counter()
      _block([f() for _ in range(k)])
      info[name]["times"].append((time.perf_counter() - t0) / k)
  for v in info.values():
    v["median_s"] = statistics.median(v["times"])
    v["min_s"] = min(v["times"])
  return info


def make_looped(fn, k: int):
  """jit(q, *rest -> q after k dependent calls of fn): device time per call without dispatch.

  Each call's q depends on the previous output (times 1e-30), so the calls cannot be hoisted or
  overlapped. Used for the Pallas variants only: in the jnp paths XLA could hoist the
  loop-invariant page gathers out of the loop.
  """

  @jax.jit
  def run(q, *rest):
    def body(_, qc):
      return qc + (fn(qc, *rest) * 1e-30).astype(qc.dtype)

    return lax.fori_loop(0, k, body, q)

  return run


def copy_bandwidth(n_bytes: int, reps: int) -> float:
  x = jnp.ones((n_bytes // 2,), jnp.bfloat16)
  f = jax.jit(lambda a: a + 1)
  t = time_pipelined({"copy": lambda: f(x)}, reps, 5e-3)["copy"]["median_s"]
  return 2 * n_bytes / t / 1e9  # read + write, GB/s


def section_kernel_speed(out, res, args):
  if args.quick:
    sizes = [(256, 4), (512, 8)]
    cfg = dict(suffix=40, hq=8, hkv=2, d=64, ps=16, dtype=jnp.bfloat16)
    reps, loop_k, target_s, copy_bytes = 3, 2, 2e-3, 32 << 20
  else:
    sizes = [(4096, 16), (16384, 64), (4096, 64), (16384, 16)]  # priority order
    cfg = dict(suffix=300, hq=32, hkv=8, d=128, ps=16, dtype=jnp.bfloat16)
    reps, loop_k, target_s, copy_bytes = 10, 20, 5e-3, 1 << 30
  out["config"] = {k: (str(jnp.dtype(v)) if k == "dtype" else v) for k, v in cfg.items()}
  out["config"].update(reps=reps, loop_iterations=loop_k, statistic="median",
                       method=("pipelined: `inner` calls then one block_until_ready, per call; "
                               "loop: fori_loop of dependent calls in one jit, per call (Pallas "
                               "only); best = min of the two (both are upper bounds on device "
                               "time)"))
  try:
    out["copy_bw_GBps"] = copy_bandwidth(copy_bytes, reps)
    log(f"  copy bandwidth (x+1, bf16, {copy_bytes >> 20} MiB): {out['copy_bw_GBps']:.0f} GB/s")
  except Exception as e:
    out["copy_bw_error"] = _err(e)["error"]
  res.save()
  rows = out.setdefault("rows", [])
  for i, (prefix, branches) in enumerate(sizes):
    if i and elapsed() > args.budget_s * 0.6:
      rows.append({"prefix": prefix, "branches": branches, "skipped": "time budget"})
      res.save()
      continue
    row = {"prefix": prefix, "branches": branches, "suffix": cfg["suffix"]}
    t0 = time.perf_counter()
    try:
      speed_row(row, i, prefix, branches, cfg, args.interpret, reps, loop_k, target_s)
    except Exception as e:
      row.update(_err(e))
      log(f"  prefix {prefix} x {branches} ERROR {row['error'][:300]}")
    row["wall_s"] = round(time.perf_counter() - t0, 2)
    rows.append(row)
    res.save()


def speed_row(row, seed, prefix, branches, cfg, interpret, reps, loop_k, target_s):
  """Fills `row` with the timings of one size; a failing method is recorded, the others run."""
  kv_token_bytes = 2 * cfg["hkv"] * cfg["d"] * jnp.dtype(cfg["dtype"]).itemsize
  pallas = functools.partial(ta.tree_attention_pallas, interpret=interpret)
  tree_args, flat_ref_args, flat_pallas_args, n_tree, n_dup = build_speed_case(
      seed, prefix, branches, cfg["suffix"], cfg["hq"], cfg["hkv"], cfg["d"], cfg["ps"],
      cfg["dtype"])
  candidates = {
      "tree_pallas": lambda: pallas(*tree_args),
      "tree_ref": lambda: ta.tree_attention_reference(*tree_args),
      "flat_ref": lambda: ta.paged_attention_reference(*flat_ref_args),
      "flat_pallas": lambda: pallas(*flat_pallas_args),
  }
  fns, outs = {}, {}
  for name, f in candidates.items():  # a failing method is recorded, the others still run
    try:
      outs[name] = np.asarray(_block(f()), np.float32)
      fns[name] = f
    except Exception as e:
      row[name] = _err(e)
      log(f"  {name} ERROR {row[name]['error'][:300]}")
  base = "flat_ref" if "flat_ref" in outs else next(iter(outs), None)
  row["max_abs_diff_vs"] = base
  row["max_abs_diff"] = {n: float(np.abs(o - outs[base]).max()) for n, o in outs.items()
                         if n != base}
  del outs
  timing = time_pipelined(fns, reps, target_s) if fns else {}
  for name, a in (("tree_pallas", tree_args), ("flat_pallas", flat_pallas_args)):
    if name not in timing:
      continue
    try:
      looped = make_looped(pallas, loop_k)
      _block(looped(*a))
      ts = []
      for _ in range(reps):
        t1 = time.perf_counter()
        _block(looped(*a))
        ts.append((time.perf_counter() - t1) / loop_k)
      timing[name]["loop_median_s"] = statistics.median(ts)
    except Exception as e:
      timing[name]["loop_error"] = _err(e)["error"]
  tokens = {"tree": prefix + branches * cfg["suffix"],
            "flat": branches * (prefix + cfg["suffix"])}
  for name, t in timing.items():
    best = min(t["median_s"], t.get("loop_median_s", float("inf")))
    nbytes = tokens[name.split("_")[0]] * kv_token_bytes
    row[name] = {"ms": 1e3 * best, "pipelined_ms": 1e3 * t["median_s"],
                 "loop_ms": 1e3 * t["loop_median_s"] if "loop_median_s" in t else None,
                 "single_call_ms": 1e3 * t["single_call_s"], "inner": t["inner"],
                 "kv_bytes_read": nbytes, "eff_GBps": nbytes / best / 1e9}
    if "loop_error" in t:
      row[name]["loop_error"] = t["loop_error"]

  def ratio(slow, fast):
    if "ms" in row.get(slow, {}) and "ms" in row.get(fast, {}):
      return row[slow]["ms"] / row[fast]["ms"]
    return None

  row["speedup_tree_pallas_vs_flat_ref"] = ratio("flat_ref", "tree_pallas")
  row["speedup_tree_pallas_vs_flat_pallas"] = ratio("flat_pallas", "tree_pallas")
  row["speedup_tree_pallas_vs_tree_ref"] = ratio("tree_ref", "tree_pallas")
  row["speedup_tree_ref_vs_flat_ref"] = ratio("flat_ref", "tree_ref")
  row["kv_pages_tree"], row["kv_pages_flat"] = n_tree, n_dup
  row["kv_mib_tree"] = n_tree * cfg["ps"] * kv_token_bytes / 2**20
  row["kv_mib_flat"] = n_dup * cfg["ps"] * kv_token_bytes / 2**20
  row["kv_memory_ratio"] = n_dup / n_tree
  # The tree kernel's prefix phase runs ceil(rows / block_m) row blocks per kv head, each
  # reading the prefix (repeat reads may hit L2, 50 MB on H100/H200).
  rows_m = branches * cfg["hq"] // cfg["hkv"]
  bm = min(gpu_kernel.MAX_BLOCK_M, max(gpu_kernel.MIN_BLOCK_M, gpu_kernel._next_pow2(rows_m)))
  row["tree_prefix_row_blocks"] = -(-rows_m // bm)
  log(f"  prefix {prefix:5d} x {branches:2d}: " + ", ".join(
      f"{n} {row[n]['ms']:.3f} ms ({row[n]['eff_GBps']:.0f} GB/s)" for n in IMPLS
      if "ms" in row.get(n, {})) + f"; tree_pallas vs flat_ref x"
      f"{row['speedup_tree_pallas_vs_flat_ref'] or float('nan'):.1f}, vs flat_pallas x"
      f"{row['speedup_tree_pallas_vs_flat_pallas'] or float('nan'):.1f}; KV x"
      f"{row['kv_memory_ratio']:.1f}")


# ---------------------------------------------------------------------------------------------
# 4. Sampler (engine) speed
# ---------------------------------------------------------------------------------------------


def section_sampler(out, res, args):
  import bench_sampler as bs
  from flax import nnx

  from trace_jax.models.qwen3 import Qwen3, Qwen3Config

  cases = res.data.get("correctness", {}).get("cases", [])
  if (ta.resolve_impl("auto") == "pallas" and cases
      and not any("max_abs_err_kernel" in c for c in cases)):
    # The kernel did not even run: measure the engine on the jnp tree path rather than not at all.
    os.environ[ta.IMPL_ENV_VAR] = "reference"
    out["fallback"] = "Pallas kernel errored in every correctness case; engine uses the reference"
    log(f"  {out['fallback']}")
  out["attention_impl_used"] = ta.resolve_impl("auto")
  # (a) The engine end to end, tiny model (f32, head_dim 32), 32 slots, tree attention on vs off.
  t0, c0 = time.perf_counter(), COMPILES.n
  try:
    graphdef, state = nnx.split(Qwen3(bs.MODELS["tiny"], rngs=nnx.Rngs(0)))
    r = bs.engine_throughput(graphdef, state, args.quick)
    r["tree_vs_plain"] = (r["tree_attention"]["generated_tok_s"]
                          / r["plain_attention"]["generated_tok_s"])
    out["tiny_engine"] = r
    log(f"  tiny engine: tree {r['tree_attention']['generated_tok_s']:.0f} tok/s, plain "
        f"{r['plain_attention']['generated_tok_s']:.0f} tok/s (x{r['tree_vs_plain']:.2f})")
  except Exception as e:
    out["tiny_engine"] = _err(e)
    log(f"  tiny engine ERROR {out['tiny_engine']['error'][:300]}")
  out["tiny_engine"]["wall_s"] = round(time.perf_counter() - t0, 2)
  out["tiny_engine"]["compiles"] = COMPILES.n - c0
  res.save()

  # (b) Shared prefix vs duplicated prefix on a bigger random-weight bf16 model.
  if args.quick:
    mcfg = Qwen3Config(vocab_size=bs.VOCAB, hidden_size=256, intermediate_size=512, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=64, tie_word_embeddings=True,
                       max_position_embeddings=4096, dtype="bfloat16", param_dtype="bfloat16")
    points, gen, need_s = [(256, 4)], 4, 0.0
  else:
    mcfg = Qwen3Config(vocab_size=bs.VOCAB, hidden_size=1024, intermediate_size=3072,
                       num_layers=8, num_heads=16, num_kv_heads=8, head_dim=128,
                       tie_word_embeddings=True, max_position_embeddings=32768,
                       rope_theta=1_000_000.0, dtype="bfloat16", param_dtype="bfloat16")
    points, gen, need_s = [(4096, 16), (4096, 64), (16384, 16)], 16, 45.0
  out["model"] = {k: (str(v) if k in ("dtype", "param_dtype") else v)
                  for k, v in vars(mcfg).items() if not k.startswith("_")}
  rows = out.setdefault("sharing", [])
  try:
    graphdef, state = nnx.split(Qwen3(mcfg, rngs=nnx.Rngs(0)))
  except Exception as e:
    out["sharing_error"] = _err(e)
    return
  for i, (prefix, branches) in enumerate(points):
    if i and args.budget_s - elapsed() < need_s:
      rows.append({"prefix": prefix, "branches": branches, "skipped": "time budget"})
      res.save()
      continue
    t0, c0 = time.perf_counter(), COMPILES.n
    try:
      row = bs.sharing_case(graphdef, state, prefix, branches, gen, 2, ("tree", "dup"))
      log(f"  model h{mcfg.hidden_size} l{mcfg.num_layers} prefix {prefix:5d} x {branches:2d}: "
          f"tree {row['tree_tok_s']:.0f} tok/s, dup {row['dup_tok_s']:.0f} tok/s "
          f"(x{row['speedup_tree_vs_dup']:.2f}); KV x{row['kv_ratio_dup_vs_tree']:.1f}")
    except Exception as e:
      row = {"prefix": prefix, "branches": branches, **_err(e)}
      log(f"  sharing {prefix} x {branches} ERROR {row['error'][:300]}")
    row["wall_s"] = round(time.perf_counter() - t0, 2)
    row["compiles"] = COMPILES.n - c0
    rows.append(row)
    res.save()


# ---------------------------------------------------------------------------------------------
# 5. One RL update step of a Qwen3-1.7B-shaped random bf16 model (f32 masters, per-layer remat)
# ---------------------------------------------------------------------------------------------

def update_flops(mcfg, rows: int, seq: int) -> dict:
  """Model FLOPs of one training step on [rows, seq] tokens: 6 per matmul weight per token
  (forward 2, backward 4) plus causal attention (QK^T and AV over seq / 2 keys on average, x3 for
  the backward). Recomputation under remat is not counted (model FLOPs, not hardware FLOPs)."""
  from bench_vs_tunix import matmul_params

  tokens = rows * seq
  dense = 6 * matmul_params(mcfg) * tokens
  attn = 3 * 2 * 2 * mcfg.num_layers * mcfg.num_heads * mcfg.head_dim * (seq / 2) * tokens
  return {"tokens": tokens, "dense": float(dense), "attention": float(attn),
          "total": float(dense + attn)}


def dense_matmul_tflops(n: int, reps: int) -> float:
  """A measured bf16 matmul rate on this device (the MFU reference of this run), TFLOP/s."""
  a = jnp.ones((n, n), jnp.bfloat16)
  f = jax.jit(lambda x: x @ x)
  t = time_pipelined({"mm": lambda: f(a)}, reps, 5e-3)["mm"]["median_s"]
  return 2 * n ** 3 / t / 1e12


def section_update(out, res, args):
  from flax import nnx

  from trace_jax.models.predictor import PredictorHead
  from trace_jax.models.qwen3 import Qwen3, get_preset
  from trace_jax.rl.batch import random_batch
  from trace_jax.rl.update import UpdateConfig, init_train_state, jit_update_step

  if args.quick:
    mcfg = get_preset("tiny", vocab_size=512, num_layers=2, dtype="bfloat16",
                      param_dtype="bfloat16")
    rows, seq, reps = 2, 64, 2
  else:
    mcfg = get_preset("qwen3_1p7b", dtype="bfloat16", param_dtype="bfloat16")
    rows, seq, reps = 8, 2048, 5
  cfg = UpdateConfig(lr=1e-6, param_dtype="bfloat16", remat="full")
  out.update(model=("tiny" if args.quick else "qwen3_1p7b"), rows=rows, seq=seq,
             remat=cfg.remat, masters=str(cfg.master_dtype), flops=update_flops(mcfg, rows, seq))
  res.save()
  graphdef, params = nnx.split(Qwen3(mcfg, rngs=nnx.Rngs(0)))
  out["params"] = int(sum(x.size for x in jax.tree.leaves(params)))
  hg, hp = nnx.split(PredictorHead(mcfg.hidden_size, 128, rngs=nnx.Rngs(1)))
  state = init_train_state(params, hp, cfg)
  del params
  batch = random_batch(rows, seq, mcfg.vocab_size, mask_rate=0.5, old_logp=-5.0)
  batch = jax.device_put(batch)
  step = jit_update_step(graphdef, hg, cfg)
  t0 = time.perf_counter()
  state, m = step(state, batch)
  _block(m)
  out["first_call_s"] = round(time.perf_counter() - t0, 2)
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    state, m = step(state, batch)
    _block(m)
    times.append(time.perf_counter() - t0)
  med = statistics.median(times)
  out["step_s_median"], out["step_s_all"] = med, times
  out["skipped"] = float(m["skipped"])
  out["tokens_per_s"] = rows * seq / med
  out["achieved_tflops"] = out["flops"]["total"] / med / 1e12
  out["matmul_tflops_measured"] = dense_matmul_tflops(1024 if args.quick else 8192, reps)
  out["mfu_vs_measured_matmul"] = out["achieved_tflops"] / out["matmul_tflops_measured"]
  try:
    out["peak_bytes_in_use"] = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
  except Exception:
    pass
  log(f"  update {out['model']} [{rows}x{seq}] remat={cfg.remat}: {med * 1e3:.0f} ms/step, "
      f"{out['achieved_tflops']:.1f} TFLOP/s, MFU {out['mfu_vs_measured_matmul']:.2f} of a "
      f"measured {out['matmul_tflops_measured']:.0f} TFLOP/s bf16 matmul")
  res.save()


# ---------------------------------------------------------------------------------------------
# 6. Plot and summary
# ---------------------------------------------------------------------------------------------

def plot(data, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = [r for r in data.get("kernel_speed", {}).get("rows", [])
          if any("ms" in r.get(n, {}) for n in IMPLS)]
  if not rows:
    return False
  labels = [f"{r['prefix'] // 1024 or r['prefix']}{'k' if r['prefix'] >= 1024 else ''}"
            f" x {r['branches']}" for r in rows]
  x = np.arange(len(rows))
  fig, ax = plt.subplots(1, 2, figsize=(12, 4.3))
  for name, style in zip(IMPLS, ("-o", "--s", "-x", "--^"), strict=True):
    ax[0].plot(x, [r.get(name, {}).get("ms", np.nan) for r in rows], style, label=name)
    ax[1].plot(x, [r.get(name, {}).get("eff_GBps", np.nan) for r in rows], style, label=name)
  bw = data["kernel_speed"].get("copy_bw_GBps")
  if bw:
    ax[1].axhline(bw, color="k", ls=":", lw=1, label=f"copy x+1 ({bw:.0f} GB/s)")
  if data.get("env", {}).get("backend") == "gpu":
    ax[1].axhline(H200_NOMINAL_GBPS, color="gray", ls="-.", lw=1, label="4.8 TB/s (H200 nominal)")
  ax[0].set_yscale("log")
  ax[0].set_ylabel("ms per decode step, one layer (median)")
  ax[1].set_ylabel("effective GB/s (KV bytes needed / time)")
  for a in ax:
    a.set_xticks(x, labels)
    a.set_xlabel("shared prefix tokens x branches")
    a.grid(alpha=0.3)
    a.legend(fontsize=7)
  env = data.get("env", {})
  cfg = data["kernel_speed"].get("config", {})
  fig.suptitle(f"Tree attention, {env.get('device_kind', '?')} (jax {env.get('jax', '?')}), "
               f"{cfg.get('dtype')} D={cfg.get('d')} Hq={cfg.get('hq')} Hkv={cfg.get('hkv')} "
               f"suffix {cfg.get('suffix')}", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def summary(data) -> list[str]:
  lines = []
  env = data.get("env", {})
  lines.append(f"env: jax {env.get('jax')} / jaxlib {env.get('jaxlib')}, {env.get('backend')} "
               f"{env.get('device_kind')}, interpret={env.get('interpret')}")
  c = data.get("correctness", {})
  lines.append(f"correctness: {c.get('passed', 0)}/{c.get('total', 0)} cases pass"
               + (f"  SECTION ERROR: {c['error'][:200]}" if "error" in c else ""))
  for r in c.get("cases", []):
    if not r.get("passed", True) or "error" in r:
      lines.append(f"  FAIL {r['case']}: " + (r.get("error", "")[:300] or
                   f"err {r.get('max_abs_err_kernel'):.3g} tol {r.get('tol')}"))
  k = data.get("kernel_speed", {})
  if "copy_bw_GBps" in k:
    lines.append(f"copy bandwidth: {k['copy_bw_GBps']:.0f} GB/s")
  for r in k.get("rows", []):
    done = [n for n in IMPLS if "ms" in r.get(n, {})]
    if done:
      fmt = lambda v: "n/a" if v is None else f"x{v:.1f}"
      lines.append(
          f"kernel {r['prefix']:5d} x {r['branches']:2d}: " + ", ".join(
              f"{n} {r[n]['ms']:.3f} ms/{r[n]['eff_GBps']:.0f} GB/s" for n in done)
          + f"; tree_pallas vs flat_ref {fmt(r['speedup_tree_pallas_vs_flat_ref'])}, vs "
          f"flat_pallas {fmt(r['speedup_tree_pallas_vs_flat_pallas'])}; KV "
          f"x{r['kv_memory_ratio']:.1f}")
      for n in IMPLS:
        if "error" in r.get(n, {}):
          lines.append(f"  {n} ERROR: {r[n]['error'][:200]}")
    else:
      lines.append(f"kernel {r.get('prefix')} x {r.get('branches')}: "
                   f"{r.get('skipped') or r.get('error', '')[:200]}")
  if "error" in k:
    lines.append(f"kernel_speed SECTION ERROR: {k['error'][:200]}")
  s = data.get("sampler", {})
  te = s.get("tiny_engine", {})
  if "tree_attention" in te:
    lines.append(f"engine tiny: tree {te['tree_attention']['generated_tok_s']:.0f} tok/s, "
                 f"plain {te['plain_attention']['generated_tok_s']:.0f} tok/s "
                 f"(x{te['tree_vs_plain']:.2f})")
  elif te:
    lines.append(f"engine tiny: {te.get('error', '')[:200]}")
  for r in s.get("sharing", []):
    if "tree_tok_s" in r:
      lines.append(f"engine h{s['model']['hidden_size']} {r['prefix']} x {r['branches']}: tree "
                   f"{r['tree_tok_s']:.0f} tok/s, dup {r['dup_tok_s']:.0f} tok/s "
                   f"(x{r['speedup_tree_vs_dup']:.2f}), KV x{r['kv_ratio_dup_vs_tree']:.1f}")
    else:
      lines.append(f"engine {r.get('prefix')} x {r.get('branches')}: "
                   f"{r.get('skipped') or r.get('error', '')[:200]}")
  u = data.get("update", {})
  if "step_s_median" in u:
    lines.append(f"update {u['model']} [{u['rows']}x{u['seq']}] remat={u['remat']}: "
                 f"{u['step_s_median'] * 1e3:.0f} ms/step, {u['achieved_tflops']:.2f} TFLOP/s, "
                 f"MFU {u['mfu_vs_measured_matmul']:.2f} of a measured bf16 matmul")
  elif u:
    lines.append(f"update: {u.get('error', 'not finished')[:200]}")
  lines.append(f"total {data.get('total_wall_s', elapsed()):.0f}s, "
               f"{data.get('total_compiles', COMPILES.n)} compiles "
               f"({data.get('total_compile_s', COMPILES.s):.0f}s)")
  return lines


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="small sizes (CPU smoke run, ~1.5 min)")
  ap.add_argument("--out_dir", default=os.environ.get("OUT") or os.path.join(ROOT, "results"))
  ap.add_argument("--name", default="gpu_check", help="output file stem")
  ap.add_argument("--budget_s", type=float, default=None,
                  help="wall budget; optional cases are skipped once spent (default 270, quick "
                       "150)")
  ap.add_argument("--sections", default="correctness,kernel_speed,sampler")
  args = ap.parse_args()
  args.budget_s = args.budget_s or (150.0 if args.quick else 270.0)
  args.interpret = jax.default_backend() != "gpu"
  # Watchdog: a hang (compile or kernel) still ends the run, with stacks in the log.
  faulthandler.dump_traceback_later(args.budget_s + 60, exit=True)
  os.makedirs(args.out_dir, exist_ok=True)
  res = Results(os.path.join(args.out_dir, args.name + ".json"))
  res.data["command"] = " ".join([os.path.basename(sys.executable)] + sys.argv)
  run_section(res, "env", section_env, args)
  sections = {"correctness": section_correctness, "kernel_speed": section_kernel_speed,
              "sampler": section_sampler, "update": section_update}
  for name in args.sections.split(","):
    if name:
      run_section(res, name, sections[name], args)
  try:
    res.data["env"]["memory_stats_end"] = {
        k: v for k, v in (jax.devices()[0].memory_stats() or {}).items()
        if k in ("bytes_limit", "bytes_in_use", "peak_bytes_in_use")}
  except Exception:
    pass
  png = os.path.join(args.out_dir, args.name + ".png")
  try:
    res.data["plot"] = png if plot(res.data, png) else None
  except Exception as e:
    res.data["plot_error"] = _err(e)["error"]
  res.data.update(total_wall_s=round(elapsed(), 1), total_compiles=COMPILES.n,
                  total_compile_s=round(COMPILES.s, 1))
  res.data["summary"] = summary(res.data)
  res.save()
  faulthandler.cancel_dump_traceback_later()
  print("\n".join(["", "==== summary ===="] + res.data["summary"]
                  + [f"wrote {res.path}" + (f" and {png}" if res.data.get("plot") else "")]),
        flush=True)


if __name__ == "__main__":
  main()
