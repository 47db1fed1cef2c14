#!/usr/bin/env bash
# The simulator against the real server on this machine: serve a workload with `tidal serve`
# and `tidal bench serve`, replay the same workload with `tidal simulate` on the calibrated
# CPU profile, and print each headline metric's relative error (target: within 15%).
# The engine core runs one torch thread, as it was calibrated: the frontend and this client
# get the other core. `--calibrate` refits the profile first (~1 min): the runner over a grid
# of step shapes, then what serving adds (`--serving-url`: the server started here times its
# own steps for 12 requests one at a time and 12 four at a time; and the request latency).
# usage: benchmarks/sim_accuracy.sh [--calibrate]
# Workload knobs: NUM_PROMPTS (100), RATE (0.5 req/s), INPUT_LEN (256), OUTPUT_LEN (64).
set -euo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${OUTDIR:-benchmarks/results/sim_accuracy}
PROFILE=${PROFILE:-tidal/sim/calibrated/cpu-smollm2-135m.json}
mkdir -p "$OUTDIR"
workload=(--dataset random --random-input-len "${INPUT_LEN:-256}" --random-range-ratio 0.5
          --random-output-len "${OUTPUT_LEN:-64}" --num-prompts "${NUM_PROMPTS:-100}"
          --request-rate "${RATE:-0.5}" --seed 0)
port=8110
setsid .venv/bin/tidal serve --port $port --num-kv-blocks 4096 --num-threads 1 \
  >"$OUTDIR/server.log" 2>&1 &
pid=$!
trap 'kill -- -$pid 2>/dev/null || true' EXIT
for _ in $(seq 300); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
  kill -0 $pid 2>/dev/null || { echo "server exited; see $OUTDIR/server.log"; exit 1; }
  sleep 1
done
if [ "${1:-}" = "--calibrate" ]; then
  .venv/bin/tidal calibrate --hardware cpu --num-threads 1 --max-batch 32 --num-kv-blocks 4096 \
    --serving-url "http://127.0.0.1:$port" --output "$PROFILE" | grep -E "^(mean|serving)"
fi
.venv/bin/tidal bench serve --base-url "http://127.0.0.1:$port" "${workload[@]}" --ignore-eos \
  --disable-tqdm --save-result --result-file "$OUTDIR/real.json" >/dev/null
kill -- -$pid; wait $pid 2>/dev/null || true; trap - EXIT
.venv/bin/tidal simulate --model-config smollm2-135m --hardware "$PROFILE" --num-kv-blocks 4096 \
  "${workload[@]}" --save-result --result-file "$OUTDIR/sim.json" --compare "$OUTDIR/real.json" \
  | sed -n '/^metric/,/^simulated/p'
