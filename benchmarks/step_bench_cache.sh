#!/usr/bin/env bash
# Issue 29 item 4: what the first RL steps compile on a machine's first run of a config, and on
# its second (XLA's persistent compilation cache, `launch/train.py --compile_cache`, on by
# default). Per setting, a fresh cache directory, then two processes on it: cold, then warm.
#   bash benchmarks/step_bench_cache.sh [method:stage2[:deadline] ...]
# Writes results/step_bench_cache/<setting>-{cold,warm}.json (bench_step's schema: setup_compiles,
# compiles_by_step and their seconds) and results/step_bench_cache.{json,png}.
set -uo pipefail
cd "$(dirname "$0")/.."
settings=("$@")
[ ${#settings[@]} -eq 0 ] && settings=(grpo:batch trace_tree:batch trace_tree:stream:0.25)
mkdir -p results/step_bench_cache logs
for s in "${settings[@]}"; do
  name=$(echo "$s" | tr ':' '_')
  cache=$(mktemp -d /tmp/step_bench_cache.XXXX)
  for pass in cold warm; do
    echo "$s $pass start $(date -u +%H:%M:%S)"
    python benchmarks/bench_step.py --settings="$s" --steps=4 --warmup=0 --no_timing \
      --compile_cache="$cache" --out="results/step_bench_cache/$name-$pass" \
      > "logs/bench_cache_$name-$pass.log" 2>&1
    echo "$s $pass done rc=$? $(date -u +%H:%M:%S)"
  done
  rm -rf "$cache"
done
python benchmarks/step_bench_cache_table.py
