#!/usr/bin/env bash
# Issue 29 item 2, counts only: rollouts one step ahead (op) against none, and 4 decode steps per
# device call (ds4) against 8, one process per setting (compiled functions are shared within a
# process).
#   bash benchmarks/step_bench_op.sh [method:stage2[:deadline][:nokeep][:op] ...]
# Writes results/step_bench_op/<setting>.{json,png}
set -uo pipefail
cd "$(dirname "$0")/.."
settings=("$@")
[ ${#settings[@]} -eq 0 ] && settings=(grpo:batch grpo:batch:op trace_tree:batch
                                       trace_tree:batch:op trace_tree:stream:0.25
                                       trace_tree:stream:0.25:op tree_grpo:stream
                                       tree_grpo:stream:op grpo:batch:op:ds4
                                       trace_tree:stream:0.25:op:ds4 grpo:batch:ds4
                                       tree_grpo:stream:op:ds4 trace_tree:batch:op:ds4)
mkdir -p results/step_bench_op logs
for s in "${settings[@]}"; do
  name=$(echo "$s" | tr ':' '_')
  echo "$s start $(date -u +%H:%M:%S)"
  python benchmarks/bench_step.py --settings="$s" --steps=6 --warmup=2 --no_timing \
    --out="results/step_bench_op/$name" > "logs/bench_op_$name.log" 2>&1
  echo "$s done rc=$? $(date -u +%H:%M:%S)"
done
