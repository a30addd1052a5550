#!/usr/bin/env bash
# One device-machine call: the end-to-end serving benchmark (`kubelora bench serve`), result under $OUT.
# As bench/h200.sh, the package is not installed there: the repo folders are copied into a namespace layout
# on PYTHONPATH. Arguments go to the benchmark (e.g. --adapters 8 32 --profile-dir "$OUT/prof").
set -uo pipefail
OUT=${OUT:-/tmp/kubelora-out}
mkdir -p "$OUT" /tmp/p/kubelora
for d in kernels engine cli bench; do cp -r "$d" /tmp/p/kubelora/; done
export PYTHONPATH=/tmp/p PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/device.txt"
timeout "${BENCH_TIMEOUT:-420}" python3 -P -m kubelora.bench.serve --write "$OUT/serving.md" "$@" 2>&1 \
  | grep -v Warning | tee "$OUT/serve.txt"
