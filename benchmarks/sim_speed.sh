#!/usr/bin/env bash
# The simulator's speed: replay the whole one-hour Azure conversation trace (19,366 requests,
# ~390k steps of the real scheduler) on a simulated H100 serving Llama-3-8B, RUNS times, and
# print the simulated requests per wall-clock second of each run and their median
# (target: >= 1,000). Only the simulation is timed, not loading the trace.
# usage: benchmarks/sim_speed.sh        knobs: RUNS (3), NUM_PROMPTS (20000)
set -euo pipefail
cd "$(dirname "$0")/.."
rates=()
for _ in $(seq "${RUNS:-3}"); do
  line=$(.venv/bin/tidal simulate --dataset azure-conv \
           --num-prompts "${NUM_PROMPTS:-20000}" --hardware h100 --model-config llama-3-8b |
         grep "of wall time")
  echo "$line"
  rates+=("$(sed -E 's/.*\(([0-9]+) requests\/s\).*/\1/' <<<"$line")")
done
median=$(printf '%s\n' "${rates[@]}" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
echo "median: $median simulated requests/s (target >= 1000): $([ "$median" -ge 1000 ] && echo met || echo MISSED)"
