"""Kernel-level benchmark: tree (shared-prefix) decode attention vs duplicated paged attention.

One decode step of one layer for B branches that share a prefix of P tokens and each own a
suffix (the turn in progress). "tree" runs `tree_attention_reference` with the prefix pages held
once; "duplicated" runs `paged_attention_reference` where every branch holds its own copy of the
prefix pages (what an engine without prefix sharing does). Both are timed side by side in one
process (interleaved runs, median after warm-up) on the default JAX backend.

  python benchmarks/bench_tree_attention.py           # writes results/tree_attention_cpu.{json,png}
  python benchmarks/bench_tree_attention.py --reps 5 --prefix 256,1024 --branches 4,16
"""

import argparse
import functools
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.kernels import paged_attention_reference, tree_attention_reference


def build_case(rng, prefix_len, branches, *, suffix_len, num_q_heads, num_kv_heads, head_dim,
               page_size, dtype):
  """Returns (tree_args, dup_args, tree_pages, dup_pages) for one shared prefix and B branches."""
  pg = -(-prefix_len // page_size)
  ps = -(-suffix_len // page_size)
  page_shape = (page_size, num_kv_heads, head_dim)
  q = jnp.asarray(rng.standard_normal((branches, num_q_heads, head_dim)), dtype)
  prefix_k = rng.standard_normal((pg, *page_shape)).astype(np.float32)
  prefix_v = rng.standard_normal((pg, *page_shape)).astype(np.float32)
  suffix_k = rng.standard_normal((branches * ps, *page_shape)).astype(np.float32)
  suffix_v = rng.standard_normal((branches * ps, *page_shape)).astype(np.float32)

  # Tree: prefix pages once, then each branch's suffix pages; ids shuffled like a live pool.
  n_tree = pg + branches * ps
  perm = rng.permutation(n_tree)
  k_tree = np.empty((n_tree, *page_shape), np.float32)
  v_tree = np.empty((n_tree, *page_shape), np.float32)
  k_tree[perm[:pg]], v_tree[perm[:pg]] = prefix_k, prefix_v
  k_tree[perm[pg:]], v_tree[perm[pg:]] = suffix_k, suffix_v
  tree_args = (
      q, jnp.asarray(k_tree, dtype), jnp.asarray(v_tree, dtype),
      jnp.asarray(perm[None, :pg], jnp.int32), jnp.asarray([prefix_len], jnp.int32),
      jnp.arange(branches, dtype=jnp.int32)[None, :],
      jnp.asarray(perm[pg:].reshape(branches, ps), jnp.int32),
      jnp.full((branches,), suffix_len, jnp.int32),
  )

  # Duplicated: every branch holds a private copy of the prefix pages followed by its suffix.
  n_dup = branches * (pg + ps)
  perm = rng.permutation(n_dup).reshape(branches, pg + ps)
  k_dup = np.empty((n_dup, *page_shape), np.float32)
  v_dup = np.empty((n_dup, *page_shape), np.float32)
  for b in range(branches):
    k_dup[perm[b, :pg]], v_dup[perm[b, :pg]] = prefix_k, prefix_v
    k_dup[perm[b, pg:]] = suffix_k[b * ps : (b + 1) * ps]
    v_dup[perm[b, pg:]] = suffix_v[b * ps : (b + 1) * ps]
  # Suffix tokens follow the prefix directly only when the prefix fills whole pages.
  assert prefix_len % page_size == 0, "duplicated layout assumes a page-aligned prefix"
  dup_args = (
      q, jnp.asarray(k_dup, dtype), jnp.asarray(v_dup, dtype), jnp.asarray(perm, jnp.int32),
      jnp.full((branches,), prefix_len + suffix_len, jnp.int32),
  )
  return tree_args, dup_args, n_tree, n_dup


def time_side_by_side(fns, reps, warmup=2):
  """Median seconds per call for each fn, runs interleaved so machine noise hits both alike."""
  for fn in fns:
    for _ in range(warmup):
      jax.block_until_ready(fn())
  times = [[] for _ in fns]
  for _ in range(reps):
    for i, fn in enumerate(fns):
      t0 = time.perf_counter()
      jax.block_until_ready(fn())
      times[i].append(time.perf_counter() - t0)
  return [statistics.median(t) for t in times]


def plot(rows, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  for prefix, color in zip(sorted({r["prefix_len"] for r in rows}), ["C0", "C1", "C2", "C3"]):
    sel = [r for r in rows if r["prefix_len"] == prefix]
    b = [r["branches"] for r in sel]
    for ax, key in ((axes[0], "ms"), (axes[1], "kv_mib")):
      ax.plot(b, [r[f"tree_{key}"] for r in sel], "-o", color=color, label=f"tree, prefix {prefix}")
      ax.plot(b, [r[f"dup_{key}"] for r in sel], "--x", color=color,
              label=f"duplicated, prefix {prefix}")
  for ax, ylabel in zip(axes, ["decode step latency (ms, median)", "KV held (MiB)"]):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("branches sharing the prefix")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
  axes[0].legend(fontsize=7)
  fig.suptitle("Tree vs duplicated-prefix paged decode attention (one layer, jnp reference, CPU)")
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--prefix", default="256,1024,4096", help="shared prefix lengths (tokens)")
  parser.add_argument("--branches", default="4,16,64", help="branches per prefix")
  parser.add_argument("--suffix", type=int, default=64, help="per-branch suffix tokens")
  parser.add_argument("--num_q_heads", type=int, default=8)
  parser.add_argument("--num_kv_heads", type=int, default=2)
  parser.add_argument("--head_dim", type=int, default=64)
  parser.add_argument("--page_size", type=int, default=16)
  parser.add_argument("--reps", type=int, default=9, help="timed runs per case (median)")
  parser.add_argument("--out", default="results/tree_attention_cpu")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()

  dtype = jnp.float32
  cfg = dict(suffix_len=args.suffix, num_q_heads=args.num_q_heads, num_kv_heads=args.num_kv_heads,
             head_dim=args.head_dim, page_size=args.page_size, dtype=dtype)
  page_bytes = 2 * args.page_size * args.num_kv_heads * args.head_dim * jnp.dtype(dtype).itemsize
  rng = np.random.default_rng(args.seed)
  tree_fn = jax.jit(tree_attention_reference)
  dup_fn = jax.jit(paged_attention_reference)

  rows = []
  t_start = time.perf_counter()
  for prefix in [int(x) for x in args.prefix.split(",")]:
    for branches in [int(x) for x in args.branches.split(",")]:
      tree_args, dup_args, n_tree, n_dup = build_case(rng, prefix, branches, **cfg)
      out_tree = tree_fn(*tree_args)
      out_dup = dup_fn(*dup_args)
      max_diff = float(jnp.abs(out_tree - out_dup).max())  # same math, so they must agree
      t_tree, t_dup = time_side_by_side(
          [functools.partial(tree_fn, *tree_args), functools.partial(dup_fn, *dup_args)],
          args.reps
      )
      row = dict(
          prefix_len=prefix, branches=branches, suffix_len=args.suffix,
          tree_ms=1e3 * t_tree, dup_ms=1e3 * t_dup, speedup=t_dup / t_tree,
          tree_kv_mib=n_tree * page_bytes / 2**20, dup_kv_mib=n_dup * page_bytes / 2**20,
          kv_ratio=n_dup / n_tree, max_abs_diff=max_diff,
      )
      rows.append(row)
      print(f"prefix {prefix:5d} branches {branches:3d}: tree {row['tree_ms']:8.2f} ms  "
            f"dup {row['dup_ms']:8.2f} ms  speedup {row['speedup']:5.2f}x  "
            f"KV {row['tree_kv_mib']:7.2f} vs {row['dup_kv_mib']:7.2f} MiB ({row['kv_ratio']:.1f}x)"
            f"  max|diff| {max_diff:.1e}", flush=True)
      del tree_args, dup_args

  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  result = dict(
      benchmark="tree_attention_decode_step",
      command="python benchmarks/bench_tree_attention.py " + " ".join(
          f"--{k}={v}" for k, v in vars(args).items()),
      machine=dict(platform=platform.platform(), processor=platform.processor(),
                   cpu_count=os.cpu_count(), backend=jax.default_backend(),
                   jax_version=jax.__version__),
      config=dict(num_q_heads=args.num_q_heads, num_kv_heads=args.num_kv_heads,
                  head_dim=args.head_dim, page_size=args.page_size, dtype="float32",
                  suffix_len=args.suffix, reps=args.reps, warmup=2, statistic="median"),
      total_seconds=time.perf_counter() - t_start,
      rows=rows,
  )
  with open(args.out + ".json", "w") as f:
    json.dump(result, f, indent=2)
  plot(rows, args.out + ".png")
  print(f"wrote {args.out}.json and {args.out}.png in {result['total_seconds']:.0f} s")


if __name__ == "__main__":
  main()
