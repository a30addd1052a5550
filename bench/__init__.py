"""kubelora benchmarks: `kubelora bench kernels` (the LoRA op), `kubelora bench engine` (the engine end to end), and
the H200 tools beside them (host time per LoRA call, offline register counts, one shape for Nsight Compute)."""
