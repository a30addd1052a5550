#!/usr/bin/env bash
# One device-machine call: the GPU kernel test sweep (fp16, bf16), then the benchmark; logs under $OUT.
# The package is not installed there: the repo folders are copied into a namespace layout on PYTHONPATH.
set -uo pipefail
OUT=${OUT:-/tmp/kubelora-out}
mkdir -p "$OUT" /tmp/p/kubelora
for d in kernels engine cli; do cp -r "$d" /tmp/p/kubelora/; done
export PYTHONPATH=/tmp/p PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/device.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/device.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_TIMEOUT:-240}" python3 -P -m pytest -p no:cacheprovider -q -x -n "${TEST_WORKERS:-8}" tests/test_kernels \
    -o addopts="" --import-mode=importlib 2>&1 | tail -n 30 | tee "$OUT/tests.txt"
fi
timeout "${BENCH_TIMEOUT:-300}" python3 -P bench/kernels.py --write "$OUT/benchmarks.md" --date 2026-11-30 "$@" \
  2>&1 | tee "$OUT/bench.txt"
