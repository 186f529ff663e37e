#!/usr/bin/env bash
# Issue 29's check: trace_tree with stage 2 streamed (deadline 0.25) against stage 2 in batch,
# default regime, equal rollouts, 3 seeds x 12 steps, the current defaults otherwise (packed
# update, 2 x 2 PPO). Resumable: a finished run is skipped.
#   bash projects/mhqa/stream_check.sh [arm ...]      (arms: batch stream; default both)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=projects/mhqa/results/stream_check
COMMON=(--config=configs/mhqa.py:tiny --set=rl.steps=12 --set=eval.every=2 --seeds=3
        --methods=trace_tree --regimes=default --budgets=rollouts)
arm() {  # arm NAME [compare.py flags...]
  local name=$1; shift
  echo "=== arm $name ($(date -u +%H:%M:%S))"
  python launch/compare.py "${COMMON[@]}" --runs="runs/stream_check/$name" --out="$OUT/$name" "$@"
}
ARMS=("$@")
[ ${#ARMS[@]} -eq 0 ] && ARMS=(batch stream)
for a in "${ARMS[@]}"; do
  case $a in
    batch) arm batch --set=rollout.stage2=batch ;;
    stream) arm stream --set=rollout.stage2=stream --set=rollout.stage2_deadline=0.25 ;;
    *) echo "unknown arm $a"; exit 2 ;;
  esac
done
