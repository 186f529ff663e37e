#!/usr/bin/env bash
# Issue 29 items 3 and 4, counts only: one process per setting, since compiled functions are
# shared within a process and `compiles_by_step` counts a process's own compilations.
#   bash benchmarks/step_bench_keep.sh [suffix] [method:stage2[:deadline][:nokeep] ...]
# Writes results/step_bench_keep/<setting><suffix>.{json,png}. The files without a suffix were
# made at commit a932271 (before stage 2's estimates were bucketed), those with `_bucketed` at
# 0702a0f.
set -uo pipefail
cd "$(dirname "$0")/.."
suffix=${1:-}
[ $# -gt 0 ] && shift
settings=("$@")
[ ${#settings[@]} -eq 0 ] && settings=(grpo:batch trace_tree:batch trace_tree:stream:0.25
                                       trace_tree:stream:0.25:nokeep trace_tree:batch:nokeep)
mkdir -p results/step_bench_keep logs
for s in "${settings[@]}"; do
  name=$(echo "$s" | tr ':' '_')$suffix
  echo "$s start $(date -u +%H:%M:%S)"
  python benchmarks/bench_step.py --settings="$s" --steps=4 --warmup=2 --no_timing \
    --out="results/step_bench_keep/$name" > "logs/bench_$name.log" 2>&1
  echo "$s done rc=$? $(date -u +%H:%M:%S)"
done
