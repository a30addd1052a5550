"""Kernel benchmark script: `python -P bench/kernels.py [--write docs/benchmarks.md]` on a CUDA machine.

The same as `kubelora bench kernels`; the code lives in `kubelora.kernels.bench_lora`.
"""

from kubelora.kernels.bench_lora import main

if __name__ == "__main__":
    raise SystemExit(main())
