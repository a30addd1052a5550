#!/usr/bin/env bash
# One device-machine call: the end-to-end engine benchmark (`kubelora bench engine`); report, JSON and log under
# $OUT. As bench/h200.sh, the package is not installed there: bench/device-env.sh lays the repo folders out on
# PYTHONPATH. Arguments go to the benchmark (e.g. --scenarios base,adapters --profile).
# A run longer than one call: --workdir DIR --checkpoint DIR/run.ckpt --stop-after S, the same command again.
# Here, on the CPU: PYTHON=.venv/bin/python bash bench/engine.sh --preset smoke
set -uo pipefail
source "$(dirname "$0")/device-env.sh"
timeout "${BENCH_TIMEOUT:-540}" "$PYTHON" -P -m kubelora.bench.engine --write "$OUT/benchmarks-engine.md" \
  --json "$OUT/benchmarks-engine.json" "$@" 2>&1 | tee "$OUT/engine.txt"
