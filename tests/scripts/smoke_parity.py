"""Smoke runs of every method (and the tool tasks) before and after a change that must not change
behaviour, and the comparison of their records.

  python tests/scripts/smoke_parity.py run --root=. --out=/tmp/parity/after
  python tests/scripts/smoke_parity.py compare /tmp/parity/before /tmp/parity/after

`run` trains each smoke run of `--root` (a checkout; its own `launch/train.py` and package, so an
older commit's worktree gives the "before" records) into `--out/<name>/`. `compare` checks that
every `metrics.jsonl` record and `summary.json` field is identical in both, wall-clock and
machine keys aside, and prints one line per run; it exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

METHODS = ("trace_tree", "trace", "root_only", "grpo", "dapo", "tree_grpo", "arpo")
SMALL = ["--config.rl.steps=2", "--config.sft.steps=3", "--config.sft.num_traces=64",
         "--config.eval.size=4", "--config.eval.probe_prompts=2"]
# (name, config argument as that checkout spells it, extra flags)
RUNS = [(m, "configs/mhqa.py:smoke", [f"--config.method={m}"]) for m in METHODS]
TOOL_TASKS = [("math", ("configs/tool_math.py:smoke", "configs/math.py:smoke")),
              ("fc", ("configs/fc.py:smoke",))]
# Keys that measure the machine, not the run.
VOLATILE = ("environment", "workdir", "plots", "path")  # path: the warm start's cache folder


def _volatile(key: str) -> bool:
  return key in VOLATILE or key.endswith(("_s", "seconds"))


def run(root: str, out: str, only: list[str] | None) -> None:
  cache = os.path.join(out, "cache")
  runs = list(RUNS)
  for name, candidates in TOOL_TASKS:
    cfg = next(c for c in candidates if os.path.exists(os.path.join(root, c.split(":")[0])))
    runs.append((name, cfg, []))
  env = dict(os.environ, PYTHONPATH=os.path.abspath(root), JAX_PLATFORMS="cpu")
  for name, cfg, extra in runs:
    if only and name not in only:
      continue
    workdir = os.path.join(out, name)
    if os.path.exists(os.path.join(workdir, "summary.json")):
      print(f"{name}: done already", flush=True)
      continue
    cmd = [sys.executable, os.path.join(root, "launch", "train.py"), f"--config={cfg}",
           f"--workdir={workdir}", f"--config.world.cache_dir={cache}/{name.split('_')[0]}",
           *SMALL, *extra]
    res = subprocess.run(cmd, cwd=root, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    with open(os.path.join(out, f"{name}.log"), "w") as f:
      f.write(res.stdout)
    print(f"{name}: exit {res.returncode}", flush=True)
    if res.returncode:
      print(res.stdout[-3000:])


def _strip(d):
  if isinstance(d, dict):
    return {k: _strip(v) for k, v in d.items() if not _volatile(k)}
  if isinstance(d, list):
    return [_strip(v) for v in d]
  if isinstance(d, float) and d != d:
    return "nan"  # NaN equals NaN here: the same value in both runs
  return d


def _records(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [_strip(json.loads(line)) for line in f if line.strip()]


def compare(a: str, b: str) -> int:
  bad = 0
  names = sorted(n for n in os.listdir(a) if os.path.exists(os.path.join(a, n, "summary.json")))
  for name in names:
    wa, wb = os.path.join(a, name), os.path.join(b, name)
    if not os.path.exists(os.path.join(wb, "summary.json")):
      print(f"{name}: missing in {b}")
      bad += 1
      continue
    ra, rb = _records(wa), _records(wb)
    sa = _strip(json.load(open(os.path.join(wa, "summary.json"))))
    sb = _strip(json.load(open(os.path.join(wb, "summary.json"))))
    diffs = [f"record {i} key {k}: {x.get(k)!r} != {y.get(k)!r}"
             for i, (x, y) in enumerate(zip(ra, rb)) for k in sorted(set(x) | set(y))
             if x.get(k) != y.get(k)]
    if len(ra) != len(rb):
      diffs.append(f"{len(ra)} records != {len(rb)}")
    diffs += [f"summary {k}: {sa.get(k)!r} != {sb.get(k)!r}" for k in sorted(set(sa) | set(sb))
              if sa.get(k) != sb.get(k)]
    keys = sum(len(r) for r in ra) + len(sa)
    status = "identical" if not diffs else f"{len(diffs)} differences"
    print(f"{name}: {len(ra)} records, {keys} values compared: {status}")
    for d in diffs[:10]:
      print("   ", d)
    bad += bool(diffs)
  return 1 if bad or not names else 0


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  sub = p.add_subparsers(dest="cmd", required=True)
  r = sub.add_parser("run")
  r.add_argument("--root", default=".")
  r.add_argument("--out", required=True)
  r.add_argument("--only", default="", help="comma-separated run names")
  c = sub.add_parser("compare")
  c.add_argument("a")
  c.add_argument("b")
  args = p.parse_args()
  if args.cmd == "run":
    os.makedirs(args.out, exist_ok=True)
    run(args.root, args.out, [s for s in args.only.split(",") if s])
  else:
    sys.exit(compare(args.a, args.b))


if __name__ == "__main__":
  main()
