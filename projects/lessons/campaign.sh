#!/usr/bin/env bash
# Issue 31's pre-registered comparison on the many-lessons world (projects/lessons/README.md says
# what is fixed and why). One `launch/compare.py` invocation per arm, world seed and warm start;
# resumable (a finished run is skipped), so the campaign is run in pieces:
#   bash projects/lessons/campaign.sh tune            # world seeds 0-1: fixes BEST_BETA
#   bash projects/lessons/campaign.sh decide          # world seed 2, warm starts 0 and 1
#   bash projects/lessons/campaign.sh control         # the negative control and the old world
#   bash projects/lessons/campaign.sh decide grpo     # one arm of a phase
#   bash projects/lessons/campaign.sh pilot WORKER    # the reduced comparison (README), WORKER 0|1
#   bash projects/lessons/campaign.sh pilot_control WORKER   # its negative control
#   bash projects/lessons/campaign.sh ablate WORKER   # trace_best's changes one at a time (README)
#   bash projects/lessons/campaign.sh replicate WORKER   # the pilot's main cell on world seed 3
#   bash projects/lessons/campaign.sh replicate4 WORKER  # ... and on world seed 4
#   bash projects/lessons/campaign.sh replicate5 WORKER  # ... and on world seed 5
#   bash projects/lessons/campaign.sh tune_binned0 WORKER  # the binned root objective, world 0
#   bash projects/lessons/campaign.sh tune_binned1 WORKER  # ... world 1 (tune seeds, README)
#   bash projects/lessons/campaign.sh worlds WORKER   # the many-worlds series (README)
#   WORLDS=100-123 TAG=fresh bash projects/lessons/campaign.sh worlds WORKER
#                                                     # ... the same series on other world seeds,
#                                                     # into results/worlds_fresh/ (TAG required)
# Then `python projects/lessons/lessons_table.py` merges every arm into results/lessons/ (the series:
# --arms projects/lessons/results/worlds, README).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=projects/lessons/results/arms
RUNS=runs/lessons
# Run length: GRPO's plateau on the world check (results/world_check_lessons.json) within 200.
STEPS=${STEPS:-200}
# Written here after the tune phase and committed before any deciding run (the issue's rule).
BEST_BETA=${BEST_BETA:-}
# The pilot's β, fixed before it ran (the config's default, set by the estimates issue before any
# run on this world); the pilot does not tune.
PILOT_BETA=0.5
PILOT_STEPS=100
PILOT_OUT=projects/lessons/results/pilot
# The many-worlds series (README, fixed before its first run): world seeds no comparison had
# used, the arms, and the RL seeds per arm and world.
SERIES_WORLDS=($(seq 6 29))
SERIES_TAG=

series_worlds() {  # the same series rerun on world seeds of the caller's (e.g. never run here):
  # WORLDS="FIRST-LAST" or a list with TAG=NAME, into results/worlds_NAME and
  # runs/lessons_worlds_NAME; one list per tag. Neither set: the pre-registered series.
  [ -z "${WORLDS:-}" ] && [ -z "${TAG:-}" ] && return 0
  [ -n "${WORLDS:-}" ] || { echo "TAG=$TAG without WORLDS: the pre-registered series takes no" \
                                 "tag; give the world seeds of the rerun (WORLDS=FIRST-LAST)" >&2
                            return 2; }
  if ! [[ "${TAG:-}" =~ ^[A-Za-z0-9_]+$ ]] || [[ "$TAG" == superseded || "$TAG" == *_superseded ]]
  then
    echo "WORLDS=$WORLDS needs TAG=NAME (letters, digits, _; not superseded): its results go" \
         "to results/worlds_NAME, apart from the pre-registered series" >&2; return 2
  fi
  local ws=() w seen=" "
  if [[ "$WORLDS" =~ ^([0-9]+)-([0-9]+)$ ]]; then
    ws=($(seq "$((10#${BASH_REMATCH[1]}))" "$((10#${BASH_REMATCH[2]}))"))
  elif [[ "$WORLDS" =~ ^[0-9]+([\ ,]+[0-9]+)*$ ]]; then
    read -ra ws <<< "${WORLDS//,/ }"
  else
    echo "WORLDS=$WORLDS: give FIRST-LAST or a list of world seeds" >&2; return 2
  fi
  SERIES_WORLDS=()
  for w in "${ws[@]}"; do  # 07 is world 7; each world once
    w=$((10#$w))
    [[ "$seen" == *" $w "* ]] || { SERIES_WORLDS+=("$w"); seen+="$w "; }
  done
  [ ${#SERIES_WORLDS[@]} -gt 0 ] || { echo "WORLDS=$WORLDS names no world seed" >&2; return 2; }
  SERIES_TAG=_$TAG
  # jobs are numbered by position in the list: a tag keeps the list it started with
  local list=runs/lessons_worlds$SERIES_TAG/worlds
  mkdir -p "$(dirname "$list")"
  [ -e "$list" ] || echo "${SERIES_WORLDS[*]}" > "$list"
  [ "$(cat "$list")" = "${SERIES_WORLDS[*]}" ] || {
    echo "TAG=$TAG ran world seeds $(cat "$list"), not ${SERIES_WORLDS[*]}: use another tag" >&2
    return 2; }
}
SERIES_ARMS=(grpo trace_paper trace_binned)
SERIES_SEEDS=2
COMMON=(--config=configs/mhqa.py:lessons --regimes=default --budgets=tokens
        --set=rl.steps="$STEPS" --set=eval.every=10)
# Issue 30's estimates, together (its best arm): tree values from children, the predictor fit
# on the unselected slice with a holdout and a 4-head ensemble, and the discovery root objective.
BEST=(--set=rl.tree_values=children --set=rl.predictor_slice=true --set=rl.predictor_holdout=0.2
      --set=rl.predictor_ensemble=4 --set=rollout.root_objective=discovery)

arm() {  # arm NAME WORLD_SEED WARM_START_SEED [compare.py flags...]
  local name=$1 world=$2 ws=$3
  shift 3
  local tag="w${world}-ws${ws}"
  echo "=== $tag/$name ($(date -u +%H:%M:%S))"
  python launch/compare.py "${COMMON[@]}" --arm="$name" --warm_start_seed="$ws" \
    --set=world.seed="$world" --runs="$RUNS/$tag/$name" --out="$OUT/$tag/$name" "$@"
}

arm_flags() {  # arm_flags NAME [BETA]: an arm's method flags, the one table of them (no spaces);
  local beta=${2:-}  # BETA: the discovery objective's β, required by the arms that have it
  case $1 in trace_best|ablate_discovery)
    [ -n "$beta" ] || { echo "arm $1 needs a β (BEST_BETA: run the tune phase first)" >&2; return 2; }
  esac
  case $1 in
    grpo|dapo|root_only) echo "--methods=$1" ;;
    trace_paper) echo --methods=trace_tree ;;
    trace_best) echo --methods=trace_tree "${BEST[@]}" --set=rollout.discovery_beta="$beta" ;;
    trace_hard) echo --methods=trace_tree --set=rollout.hard_prompts=4 ;;
    ablate_fit) echo --methods=trace_tree "${BEST[@]:1:3}" ;;
    ablate_fit_paid) echo --methods=trace_tree "${BEST[@]:1:3}" --set=rollout.prefix_budget=16 ;;
    ablate_discovery) echo --methods=trace_tree "${BEST[4]}" --set=rollout.discovery_beta="$beta" ;;
    trace_binned) echo --methods=trace_tree --set=rollout.root_objective=binned ;;
    *) echo "unknown arm $1" >&2; return 2 ;;
  esac
}

decide_arm() {  # decide_arm NAME WORLD WS [extra flags]: the six pre-registered arms, their seeds
  local name=$1 world=$2 ws=$3 seeds flags
  shift 3
  case $name in
    grpo|trace_paper|trace_best) seeds=--seeds=5 ;;
    dapo|root_only) seeds=--baseline_seeds=3 ;;
    trace_hard) seeds=--seeds=3 ;;
    *) echo "unknown arm $name"; return 2 ;;
  esac
  flags=$(arm_flags "$name" "$BEST_BETA") || return 2
  read -ra flags <<< "$flags"
  arm "$name" "$world" "$ws" "${flags[@]}" "$seeds" "$@"
}

claim() {  # claim DIR: take a job, or retake an unfinished one whose worker on this host stopped
  local pid="" host=""
  if mkdir "$1" 2>/dev/null; then echo "$$ $(hostname)" > "$1/owner"; return 0; fi
  [ -e "$1/done" ] && return 1
  read -r pid host < "$1/owner" 2>/dev/null || return 1
  [ -n "$pid" ] && [ "$host" = "$(hostname)" ] && ! kill -0 "$pid" 2>/dev/null || return 1
  mkdir "$1/retaken_from_$pid" 2>/dev/null || return 1  # one worker retakes it
  echo "$$ $(hostname)" > "$1/owner"
  echo "retaking job $(basename "$1"): its worker ($pid) has stopped"
}

seed_major() {  # seed_major WS FROM TO ARM...: a job "ARM K WS" per K in FROM..TO, every arm at K
  local ws=$1 from=$2 to=$3 k a    # before any at K + 1 (a worker's "ARM K" runs seeds below K)
  shift 3
  for k in $(seq "$from" "$to"); do for a in "$@"; do echo "$a $k $ws"; done; done
}

phase() {
  local p=$1
  shift
  local only=("$@") flags=() best=()
  case $p in
    tune)  # world seeds 0-1, warm start 0, 2 RL seeds: β of the estimates arm, grpo beside it
      for world in 0 1; do
        for beta in 0.25 0.5 1.0; do
          [ ${#only[@]} -gt 0 ] && [[ ! " ${only[*]} " =~ " beta$beta " ]] && continue
          read -ra flags <<< "$(arm_flags trace_best "$beta")"
          arm "tune_beta$beta" "$world" 0 "${flags[@]}" --seeds=2
        done
        [ ${#only[@]} -eq 0 ] || [[ " ${only[*]} " =~ " grpo " ]] && \
          arm tune_grpo "$world" 0 --methods=grpo --seeds=2
      done ;;
    decide)  # world seed 2 (never used to fix a knob), warm starts 0 and 1
      local arms=(grpo trace_paper trace_best dapo root_only trace_hard)
      [ ${#only[@]} -gt 0 ] && arms=("${only[@]}")
      for ws in 0 1; do for a in "${arms[@]}"; do decide_arm "$a" 2 "$ws"; done; done ;;
    control)  # world seed 2 with uniform frequency and one ε for every lesson, then the old world
      local flat=(--set=world.zipf_exponent=0 --set=world.expert_rate_lo=0.55
                  --set=world.expert_rate_hi=0.55)
      if [ -z "$BEST_BETA" ]; then echo "BEST_BETA is not set: run the tune phase first"; return 2; fi
      read -ra best <<< "$(arm_flags trace_best "$BEST_BETA")"
      arm control_grpo 2 0 --methods=grpo --seeds=3 "${flat[@]}"
      arm control_trace_paper 2 0 --methods=trace_tree --seeds=3 "${flat[@]}"
      arm control_trace_best 2 0 "${best[@]}" --seeds=3 "${flat[@]}"
      arm old_grpo 0 0 --config=configs/mhqa.py:tiny --methods=grpo --seeds=3
      arm old_trace_best 0 0 --config=configs/mhqa.py:tiny "${best[@]}" --seeds=3 ;;
    pilot|pilot_control|ablate|replicate|replicate4|replicate5|tune_binned0|tune_binned1)
      # pilot: the reduced comparison fixed in the README before it ran: world seed 2, PILOT_STEPS
      # steps, grpo / trace_paper / trace_best (β = PILOT_BETA, not tuned). pilot_control: its
      # negative control, the same world with uniform frequency and one ε (0.55) for every lesson,
      # grpo and trace_paper, warm start 0, seeds 0-1 (fixed in the README before it ran).
      # ablate: trace_paper plus one of trace_best's two changes (the fit, the discovery
      # objective), on the cell where the combination lost (world seed 2, warm start 1), seeds
      # 0-1 then 2 (README). Children values are every arm's default, trace_paper's too.
      # replicate: grpo and trace_paper on world seed 3 (never run before), warm start 0, seeds
      # 0-2 (README). replicate4: the same on world seed 4 (never run before), fixed after
      # replicate's result (README). replicate5: the same on world seed 5, fixed before
      # replicate4's result was seen (README). tune_binnedW: grpo, trace_paper and trace_binned
      # (the binned root objective) on tune world seed W (0 or 1), warm start 0, seeds 0-1.
      # Two workers share the list (seed 0 of every arm first); a lock per arm keeps one run of an
      # arm at a time, so `--seeds=k` never restarts a seed the other worker is running.
      local worker=${only[0]:-0} jobs k=0 claims=runs/lessons_pilot/claims prefix="" world=()
      local world_seed=2
      if [ "$p" = pilot ]; then
        mapfile -t jobs < <(seed_major 0 1 3 grpo trace_best trace_paper
                            # The extension (README): warm start 1, seeds 0-1.
                            seed_major 1 1 2 grpo trace_best trace_paper
                            # Second extension (README): seed 2 on warm start 1, a 3 x 2 design.
                            seed_major 1 3 3 grpo trace_best trace_paper)
      elif [ "$p" = ablate ]; then
        mapfile -t jobs < <(seed_major 1 1 3 ablate_fit ablate_discovery
                            # Its follow-up (README): the fit with the slice paid from stage 2.
                            seed_major 1 1 3 ablate_fit_paid)
        claims=runs/lessons_pilot/claims_ablate
      elif [ "$p" = replicate ]; then
        mapfile -t jobs < <(seed_major 0 1 3 grpo trace_paper)
        claims=runs/lessons_pilot/claims_replicate world_seed=3
      elif [ "${p#tune_binned}" != "$p" ]; then
        mapfile -t jobs < <(seed_major 0 1 2 grpo trace_paper trace_binned)
        world_seed=${p#tune_binned}
        claims=runs/lessons_pilot/claims_$p
      elif [ "$p" = replicate4 ] || [ "$p" = replicate5 ]; then
        mapfile -t jobs < <(seed_major 0 1 3 grpo trace_paper)
        world_seed=${p#replicate}
        claims=runs/lessons_pilot/claims_$p
      else
        mapfile -t jobs < <(seed_major 0 1 2 grpo trace_paper)
        claims=runs/lessons_pilot/claims_control prefix=control_
        world=(--set=world.zipf_exponent=0 --set=world.expert_rate_lo=0.55
               --set=world.expert_rate_hi=0.55)
      fi
      mkdir -p "$claims"
      for j in "${jobs[@]}"; do
        k=$((k + 1))
        claim "$claims/$k" || continue  # taken by the other worker
        set -- $j
        local name=$1 seeds=$2 ws=${3:-0} extra=()
        read -ra extra <<< "$(arm_flags "$name" "$PILOT_BETA")"
        echo "worker $worker: $prefix$name seeds<$seeds warm start $ws"
        (  # a subshell holding the arm's lock; the pilot's own steps, runs and output folders
          flock 9
          OUT=$PILOT_OUT RUNS=runs/lessons_pilot COMMON[3]=--set=rl.steps=$PILOT_STEPS
          arm "$prefix$name" "$world_seed" "$ws" --seeds="$seeds" "${extra[@]}" "${world[@]}"
        ) 9>"$claims/lock_${name}_$ws" && touch "$claims/$k/done"
      done ;;
    worlds)  # the many-worlds series (README): SERIES_WORLDS, warm start 0, PILOT_STEPS steps,
      # SERIES_ARMS. A job is one world at one RL seed, its arms run one after the other by one
      # worker (which builds that world's warm start; no worker waits on another's), every world
      # at seed 0 before any world at seed 1. Outputs under results/worlds/w{W}-ws0/{arm}/;
      # the logs hold no tables (the series' table is made once, after its last run).
      series_worlds || return 2
      local worker=${only[0]:-0} k=0 s w a claims=runs/lessons_worlds$SERIES_TAG/claims
      mkdir -p "$claims"
      for s in $(seq 1 "$SERIES_SEEDS"); do
        for w in "${SERIES_WORLDS[@]}"; do
          k=$((k + 1))
          claim "$claims/$k" || continue  # taken by the other worker
          echo "worker $worker: world $w, seeds<$s"
          (  # a lock per world: never two runs of one world's seeds at once
            flock 9
            OUT=projects/lessons/results/worlds$SERIES_TAG RUNS=runs/lessons_worlds$SERIES_TAG
            COMMON[3]=--set=rl.steps=$PILOT_STEPS
            for pass in 1 2; do
              for a in "${SERIES_ARMS[@]}"; do
                read -ra extra <<< "$(arm_flags "$a" "$PILOT_BETA")"
                arm "$a" "$w" 0 --seeds="$s" --noprint_summary "${extra[@]}" || exit 1
              done
              # Arms of this seed from two warm starts (one lost in a move to another machine)
              # are not paired: those not from the cached one leave the series and are rerun
              # (README, the series' amended "Failures" rule).
              python projects/lessons/supersede.py --cell "$OUT/w$w-ws0" --runs "$RUNS/w$w-ws0" \
                --seed $((s - 1)) --dest "projects/lessons/results/worlds${SERIES_TAG}_superseded"
              case $? in 0) break ;; 3) [ "$pass" = 1 ] || exit 1 ;; *) exit 1 ;; esac
            done
          ) 9>"$claims/lock_w$w" && touch "$claims/$k/done"
        done
      done ;;
    *) echo "unknown phase $p (tune, decide, control, pilot, pilot_control, ablate, replicate," \
            "replicate4, replicate5, tune_binned0, tune_binned1, worlds)"; return 2 ;;
  esac
}

[ $# -eq 0 ] && { echo "usage: $0 tune|decide|control [arm ...]"; exit 2; }
phase "$@"
