#!/usr/bin/env bash
# Issue 32's side-by-side of trace_tree and grpo on each tool task family: 3 RL seeds each from
# one warm start (sft.seed 0), the families' main-job settings, equal rollouts. Resumable.
#   bash projects/tool_tasks/compare.sh [math|fc ...]     (default: both)
set -uo pipefail
cd "$(dirname "$0")/../.."
FAMILIES=("$@")
[ ${#FAMILIES[@]} -eq 0 ] && FAMILIES=(math fc)
for f in "${FAMILIES[@]}"; do
  echo "=== $f ($(date -u +%H:%M:%S))"
  python launch/compare.py --config="configs/$f.py" --methods=trace_tree,grpo --seeds=3 \
    --regimes=default --budgets=rollouts --runs="runs/tool_tasks/$f" \
    --out="projects/tool_tasks/results/$f" || echo "family $f failed (exit $?)"
done
