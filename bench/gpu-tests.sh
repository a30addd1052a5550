#!/usr/bin/env bash
# Every GPU test in one device-machine call: tests/test_kernels (each kernel against its reference on the GPU)
# and the tests marked `gpu` (tests/test_engine: the engine on CUDA, its graphs against eager steps and
# transformers+PEFT). Log under $OUT (gpu-tests.txt, the slowest tests in gpu-durations.txt); the exit status is
# pytest's, non-zero if either run failed. On the device machine (`make test-gpu` where the package is installed):
#   WHEELS=.whl bash bench/gpu-tests.sh     # .whl: peft, pytest-xdist, ... where that machine lacks them
# TEST_WORKERS (8): pytest-xdist workers sharing the one GPU; TEST_TIMEOUT (540): seconds for both runs together.
set -uo pipefail
source "$(dirname "$0")/device-env.sh"
workers=${TEST_WORKERS:-8}
deadline=$((SECONDS + ${TEST_TIMEOUT:-540}))
run() {  # pytest over the named tests, within what is left of the time limit
  timeout $((deadline - SECONDS)) "$PYTHON" -P -m pytest -p no:cacheprovider -q -n "$workers" -o addopts="" \
    --import-mode=importlib -rfE --durations=15 "$@"
}
{
  status=0
  run tests/test_kernels || status=$?
  run -m gpu tests/test_engine || status=$?
  exit "$status"
} 2>&1 | tee "$OUT/gpu-tests.txt"
status=${PIPESTATUS[0]}
grep -A 18 "slowest .* durations" "$OUT/gpu-tests.txt" > "$OUT/gpu-durations.txt"
exit "$status"
