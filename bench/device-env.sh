# Sourced by the GPU-machine scripts (bench/h200.sh, bench/engine.sh, bench/gpu-tests.sh): the package is not
# installed there, so the repo folders are copied into a namespace layout on PYTHONPATH. WHEELS=DIR installs the
# wheels in DIR whose distribution python3 lacks (e.g. peft and pytest-xdist, carried as wheels) into /tmp/site.
OUT=${OUT:-/tmp/kubelora-out}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT" /tmp/p/kubelora
for d in kernels engine contract router cli bench; do rm -rf "/tmp/p/kubelora/$d"; cp -r "$d" /tmp/p/kubelora/; done
export PYTHONPATH=/tmp/p${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ -n "${WHEELS:-}" ]; then
  missing=()
  for wheel in "$WHEELS"/*.whl; do
    name=$(basename "$wheel" | cut -d- -f1)
    "$PYTHON" -m pip show -q "$name" >/dev/null 2>&1 || missing+=("$wheel")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${missing[@]}"
    export PYTHONPATH=$PYTHONPATH:/tmp/site
  fi
fi
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/device.txt"
fi
"$PYTHON" - <<'PY' | tee -a "$OUT/device.txt"
import importlib.metadata as m
print(*(f"{name} {m.version(name)}" for name in ("torch", "triton", "transformers", "peft")
        if any(d.metadata["Name"] == name for d in m.distributions())))
PY
