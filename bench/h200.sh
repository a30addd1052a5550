#!/usr/bin/env bash
# One device-machine call: every GPU test (bench/gpu-tests.sh), then the kernel benchmark; logs under $OUT.
# The package is not installed there: bench/device-env.sh lays the repo folders out on PYTHONPATH.
# PDL=1 first probes programmatic dependent launch in its own process (a failed launch can leave the CUDA
# context unusable); where it works, the variant comparison (COMPARE=1, or --compare NAME...) times the PDL
# variants too. The default decode launches use PDL on Hopper either way. SKIP_TESTS=1: the benchmark only.
set -uo pipefail
source "$(dirname "$0")/device-env.sh"
extra=()
if [ "${PDL:-0}" = 1 ] && timeout 90 python3 -P -c 'from kubelora.bench.variants import probe_pdl; probe_pdl()' \
    2>&1 | tail -n 3 | tee -a "$OUT/device.txt"; then
  extra+=(--pdl)
fi
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  bash "$(dirname "$0")/gpu-tests.sh"
fi
[ "${COMPARE:-0}" = 1 ] && extra+=(--compare)
timeout "${BENCH_TIMEOUT:-300}" python3 -P -m kubelora.bench.kernels --write "$OUT/benchmarks.md" --date "${DATE:-$(date -u +%F)}" \
  "${extra[@]}" "$@" 2>&1 | tee "$OUT/bench.txt"
