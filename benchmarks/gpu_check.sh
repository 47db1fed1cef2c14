#!/usr/bin/env bash
# The GPU checks in one run, on a machine with CUDA and torch: the kernels compiled (the
# same tests CI runs under Triton's interpreter), the `-m gpu` tests, then the decode
# benchmark. Logs go to $1 (default benchmarks/results/gpu).
#   usage: benchmarks/gpu_check.sh [outdir] [extra gpu_decode.py flags]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/gpu}
shift || true
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" | tee "$out/device.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_prefill_kernel.py \
    tests/test_fused_kernels.py 2>&1 | tee "$out/kernels.log"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py 2>&1 | tee "$out/gpu_tests.log"
python3 benchmarks/gpu_decode.py "$@" 2>&1 | tee "$out/gpu_decode.log"
