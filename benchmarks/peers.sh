#!/usr/bin/env bash
# tidal against its peers on this machine: tidal, vLLM's CPU build and llama.cpp's
# llama-server serve the embedded SmolLM2-135M one at a time; each gets the same workload
# (64 chat requests x 64 output tokens, ignore_eos, temperature 0) at concurrency 1, 16 and
# 64, driven by `tidal bench serve`; one table prints tidal's ratio to each peer. Every
# engine is warmed up alike (64 requests at 64) and each concurrency gets prompts of its own
# seed: no run is served from the prefix cache an earlier one filled.
# usage: benchmarks/peers.sh [ENGINES...]   (default: tidal tidal-dense vllm llama)
# tidal serves the GGUF's Q4_1 weights in their own format, as llama-server does;
# tidal-dense serves a bf16 copy of them (--quantization none).
# The peers install or build once into $PEERS_DIR (default /tmp/peers): see benchmarks/peers/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
PEERS=${PEERS:-benchmarks/peers}
OUTDIR=${OUTDIR:-benchmarks/results/peers}
CONCURRENCY=${CONCURRENCY:-"1 16 64"}
NUM_PROMPTS=${NUM_PROMPTS:-64}
engines=${*:-tidal tidal-dense vllm llama}
mkdir -p "$OUTDIR"
# vLLM reads safetensors: the GGUF's cache folder gets its float32 copy (once)
model_dir=$($PY -c "from tidal.model.registry import dense_weights, resolve_model
folder = resolve_model('smollm2-135m')[0]; dense_weights(folder); print(folder)")
gguf=$($PY -c "from tidal.model.registry import embedded_gguf; print(embedded_gguf('smollm2-135m'))")

wait_healthy() {  # port pid
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || { echo "server exited; see $OUTDIR/$engine.log"; return 1; }
    sleep 1
  done
  return 1
}

for engine in $engines; do
  case $engine in
    tidal) port=8100; setsid .venv/bin/tidal serve --port $port >"$OUTDIR/$engine.log" 2>&1 & ;;
    tidal-dense) port=8103; setsid .venv/bin/tidal serve --port $port --quantization none \
      >"$OUTDIR/$engine.log" 2>&1 & ;;
    vllm) port=8101; setsid "$PEERS/vllm_cpu.sh" "$model_dir" $port >"$OUTDIR/$engine.log" 2>&1 & ;;
    llama) port=8102; setsid "$PEERS/llama_server.sh" "$gguf" $port 64 >"$OUTDIR/$engine.log" 2>&1 & ;;
    *) echo "unknown engine $engine (tidal, tidal-dense, vllm, llama)"; exit 2 ;;
  esac
  pid=$!
  trap 'kill -- -$pid 2>/dev/null || true' EXIT
  wait_healthy $port $pid
  bench() {  # concurrency seed [more arguments]
    $PY -m tidal.cli bench serve --base-url "http://127.0.0.1:$port" --backend "$engine" \
      --endpoint /v1/chat/completions --dataset random --random-input-len 64 \
      --random-output-len 64 --num-prompts "$NUM_PROMPTS" --max-concurrency "$1" \
      --seed "$2" --ignore-eos --temperature 0 --disable-tqdm "${@:3}"
  }
  bench 64 1000 >/dev/null  # the warm-up: prompts no run below sends
  for c in $CONCURRENCY; do
    echo "== $engine, concurrency $c"
    bench "$c" "$c" --save-result --result-file "$OUTDIR/$engine-c$c.json" |
      grep -E "throughput|Median (TTFT|TPOT)"
  done
  kill -- -$pid 2>/dev/null || true
  wait $pid 2>/dev/null || true
  trap - EXIT
done
$PY benchmarks/peers_table.py "$OUTDIR"
