#!/usr/bin/env bash
# Issue 29's check of rollouts one step ahead: off_policy_steps=1 against 0, default regime, equal
# rollouts, 3 seeds x 12 steps, evaluation every 4 steps and one checkpoint at the end (a step
# followed by either starts nothing ahead: 9 of the 12 steps run ahead). Resumable: a finished
# run is skipped.
#   bash projects/mhqa/offpolicy_check.sh [arm ...]
#   (arms: grpo_op0 grpo_op1 trace_op0 trace_op1; default the grpo pair; trace_* stream stage 2
#    with deadline 0.25)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=projects/mhqa/results/offpolicy_check
COMMON=(--config=configs/mhqa.py:tiny --set=rl.steps=12 --set=eval.every=4 --set=ckpt.every=12
        --seeds=3 --regimes=default --budgets=rollouts)
TRACE=(--methods=trace_tree --set=rollout.stage2=stream --set=rollout.stage2_deadline=0.25)
arm() {  # arm NAME [compare.py flags...]
  local name=$1; shift
  echo "=== arm $name ($(date -u +%H:%M:%S))"
  python launch/compare.py "${COMMON[@]}" --runs="runs/offpolicy_check/$name" --out="$OUT/$name" \
    "$@"
}
ARMS=("$@")
[ ${#ARMS[@]} -eq 0 ] && ARMS=(grpo_op0 grpo_op1)
for a in "${ARMS[@]}"; do
  case $a in
    grpo_op0) arm grpo_op0 --methods=grpo --set=rollout.off_policy_steps=0 ;;
    grpo_op1) arm grpo_op1 --methods=grpo --set=rollout.off_policy_steps=1 ;;
    trace_op0) arm trace_op0 "${TRACE[@]}" --set=rollout.off_policy_steps=0 ;;
    trace_op1) arm trace_op1 "${TRACE[@]}" --set=rollout.off_policy_steps=1 ;;
    *) echo "unknown arm $a"; exit 2 ;;
  esac
done
