#!/usr/bin/env bash
# One device-machine call: the end-to-end engine benchmark (`kubelora bench engine`); report, JSON and log under
# $OUT. As bench/h200.sh, the package is not installed there: the repo folders are copied into a namespace layout
# on PYTHONPATH. Arguments go to the benchmark (e.g. --scenarios base,adapters --profile).
# A run longer than one call: --workdir DIR --checkpoint DIR/run.ckpt --stop-after S, the same command again.
# Here, on the CPU: PYTHON=.venv/bin/python bash bench/engine.sh --preset smoke
set -uo pipefail
OUT=${OUT:-/tmp/kubelora-out}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT" /tmp/p/kubelora
for d in kernels engine cli bench; do rm -rf "/tmp/p/kubelora/$d"; cp -r "$d" /tmp/p/kubelora/; done
export PYTHONPATH=/tmp/p${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/device.txt"
fi
timeout "${BENCH_TIMEOUT:-540}" "$PYTHON" -P -m kubelora.bench.engine --write "$OUT/benchmarks-engine.md" \
  --json "$OUT/benchmarks-engine.json" "$@" 2>&1 | tee "$OUT/engine.txt"
