"""kubelora compute kernels: Triton ops, each with its plain-PyTorch reference."""
