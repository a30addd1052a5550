#!/usr/bin/env bash
# One device-machine call: the GPU kernel test sweep (fp16, bf16), then the benchmark; logs under $OUT.
# The package is not installed there: the repo folders are copied into a namespace layout on PYTHONPATH.
# PDL=1 first probes programmatic dependent launch in its own process (a failed launch can leave the CUDA
# context unusable); where it works, the variant comparison (COMPARE=1, or --compare NAME...) times the PDL
# variants too. The default decode launches use PDL on Hopper either way. TEST_K: a pytest -k expression
# (e.g. slice), SKIP_TESTS=1: the benchmark only.
set -uo pipefail
OUT=${OUT:-/tmp/kubelora-out}
mkdir -p "$OUT" /tmp/p/kubelora
for d in kernels engine cli bench; do cp -r "$d" /tmp/p/kubelora/; done
export PYTHONPATH=/tmp/p PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/device.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/device.txt"
extra=()
if [ "${PDL:-0}" = 1 ] && timeout 90 python3 -P -c 'from kubelora.bench.variants import probe_pdl; probe_pdl()' \
    2>&1 | tail -n 3 | tee -a "$OUT/device.txt"; then
  extra+=(--pdl)
fi
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_TIMEOUT:-240}" python3 -P -m pytest -p no:cacheprovider -q -n "${TEST_WORKERS:-8}" tests/test_kernels \
    -o addopts="" --import-mode=importlib -rfE ${TEST_K:+-k "$TEST_K"} 2>&1 | tee "$OUT/tests_full.txt" | tail -n 30 | tee "$OUT/tests.txt"
fi
[ "${COMPARE:-0}" = 1 ] && extra+=(--compare)
timeout "${BENCH_TIMEOUT:-300}" python3 -P -m kubelora.bench.kernels --write "$OUT/benchmarks.md" --date "${DATE:-$(date -u +%F)}" \
  "${extra[@]}" "$@" 2>&1 | tee "$OUT/bench.txt"
