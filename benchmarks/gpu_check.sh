#!/usr/bin/env bash
# The GPU checks in one run, on a machine with CUDA and torch, each bounded by its own time
# limit so that one hang leaves the others' logs: the device's versions; the kernel tests
# compiled (the tests CI runs under Triton's interpreter) beside the `-m gpu` tests; the
# decode benchmark on Llama-3-8B shapes; the `h100-*` calibrations; optionally the served
# comparison (GPU_SERVE=1). Logs and fitted profiles go to $1 (default benchmarks/results/gpu).
#   usage: benchmarks/gpu_check.sh [outdir] [extra gpu_decode.py flags]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/gpu}
shift || true
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
t0=$(date +%s)
stage() { echo "[$(($(date +%s) - t0)) s] $*"; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'triton', triton.__version__, torch.cuda.get_device_name())"; } 2>&1 | tee "$out/device.txt"
(timeout "${T_TESTS:-150}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py \
    > "$out/gpu_tests.log" 2>&1; echo "exit $?" >> "$out/gpu_tests.log") &
timeout "${T_TESTS:-150}" python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py \
    tests/test_prefill_kernel.py tests/test_fused_kernels.py > "$out/kernels.log" 2>&1
echo "exit $?" >> "$out/kernels.log"
wait
stage "tests"; tail -n 2 "$out/gpu_tests.log" "$out/kernels.log"
timeout "${T_DECODE:-240}" python3 benchmarks/gpu_decode.py --models llama-3-8b --batch 1 64 \
    --context 1024 --prefill 8192 --concurrency 64 --waves 1 "$@" 2>&1 | tee "$out/gpu_decode.log"
stage "decode"
python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path
from gpu_decode import dummy_folder
for name in ('llama-3-8b', 'smollm2-135m'): dummy_folder(Path('$out/models'), name)"
for model in llama-3-8b smollm2-135m; do
    timeout "${T_CALIBRATE:-90}" python3 -m tidal.cli calibrate --hardware h100 \
        --model "$out/models/$model" --load-format dummy --dtype bfloat16 --device cuda \
        --max-batch 256 --max-prefill 8192 --output "$out/h100-$model.json" \
        > "$out/calibrate-$model.txt" 2>&1
    tail -n 2 "$out/calibrate-$model.txt"
done
stage "calibration"
if [ "${GPU_SERVE:-0}" = 1 ]; then
    timeout "${T_SERVE:-300}" python3 benchmarks/gpu_serve.py --concurrency 64 2>&1 \
        | tee "$out/gpu_serve.log"
    stage "serve"
fi
