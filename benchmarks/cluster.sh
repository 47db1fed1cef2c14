#!/usr/bin/env bash
# One engine vs data parallel vs 1P1D on this machine, same workload, same total threads:
#   mixed     tidal serve --num-threads 2
#   dp2       tidal serve --data-parallel-size 2 --num-threads 1
#   pd1p1d    tidal serve --pd 1P1D --num-threads 1
# Workload: 64 random requests (256 prompt, 64 output tokens, ignore_eos) at concurrency 16.
# Usage: benchmarks/cluster.sh [extra bench flags]   (results in /tmp/tidal-cluster-*.json)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
PORT=${PORT:-8310}
run() {
  local name=$1; shift
  $PY -m tidal.cli serve --port "$PORT" --num-kv-blocks 512 "$@" > "/tmp/tidal-cluster-$name.log" 2>&1 &
  local pid=$!
  for _ in $(seq 180); do
    curl -sf "localhost:$PORT/health" > /dev/null && break
    kill -0 $pid 2> /dev/null || { echo "$name: server exited"; tail "/tmp/tidal-cluster-$name.log"; exit 1; }
    sleep 1
  done
  $PY -m tidal.cli bench serve --port "$PORT" --dataset random --num-prompts 64 \
    --random-input-len 256 --random-output-len 64 --random-range-ratio 0 --ignore-eos \
    --max-concurrency 16 --disable-tqdm --save-result \
    --result-file "/tmp/tidal-cluster-$name.json" "${EXTRA[@]}" > /dev/null
  kill -TERM $pid; wait $pid || true
}
EXTRA=("$@")
run mixed --num-threads 2
run dp2 --data-parallel-size 2 --num-threads 1
run pd1p1d --pd 1P1D --num-threads 1
$PY - <<'PYEOF'
import json
print(f"| setup | output tok/s | median TTFT ms | median TPOT ms | ratio to mixed |")
print("| --- | --- | --- | --- | --- |")
base = None
for name in ("mixed", "dp2", "pd1p1d"):
    r = json.load(open(f"/tmp/tidal-cluster-{name}.json"))
    base = base or r["output_throughput"]
    print(f"| {name} | {r['output_throughput']:.1f} | {r['median_ttft_ms']:.0f} | "
          f"{r['median_tpot_ms']:.1f} | {r['output_throughput'] / base:.2f}x |")
PYEOF
