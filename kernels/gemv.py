"""Single-row linear layers as one weight-streaming Triton launch: y = x W^T (+ b) for one row of x.

At a decode batch of one token a projection is a matrix-vector product and all its time is the read of W. cuBLAS
runs the narrow projections (o, down) as split-K kernels plus a reduction launch each; here one program owns
BLOCK_N output columns, walks K in BLOCK_K chunks summing the products elementwise in float32 registers and
reduces across the chunk once at the end (no shuffles or barriers inside the loop to stall the next chunk's
loads), so each weight byte is read once and nothing but y leaves the chip. 32 back-to-back launches on distinct
weights (as 32 layers) in one CUDA graph on an H200, per launch: qkv 25.8 us against cuBLAS's 27.4, o 10.7
against 12.6, gate_up 45.2 against 45.9, down 23.3 against 27.1 (3.8-4.0 TB/s against 2.7-3.9). With more rows
the weights are read once either way and cuBLAS's tensor-core tiles win, so the engine uses it for one row only.
SiLU x mul applied inside the down projection's loads was slower (28.8 us against 28.3 for silu_mul + cuBLAS): each
program recomputes the activation for its columns.

`linear_torch` is the reference with the same signature (F.linear). The Triton op sums in another order than
cuBLAS: results agree to float32 rounding before the one cast to the dtype. With a bias in bfloat16, cuBLAS (on
CUDA) rounds the product to bfloat16 before adding the bias, so the reference rounds twice where this op rounds
once. The engine runs that cuBLAS path for steps of more than one row (engine/model/llama.py `_linear`, Qwen2's
q/k/v biases), as transformers' nn.Linear does: equality with transformers+PEFT goes through the same call. Launches are CUDA-graph safe (grid and
blocks from shapes only); the first call per shape compiles.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def linear_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: F.linear(x, weight, bias)."""
    return F.linear(x, weight, bias)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, w_stride, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols < N
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * w_stride + ks[None, :]
    x_ptrs = x_ptr + ks
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
            x = tl.load(x_ptrs)
        else:
            k_ok = (k + ks) < K
            w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=k_ok, other=0.0)
        acc += x.to(tl.float32)[None, :] * w.to(tl.float32)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + cols, y.to(y_ptr.dtype.element_ty), mask=col_ok)


def is_interpreted() -> bool:
    """True when the kernel was built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return type(_gemv_kernel).__name__ == "InterpretedFunction"


def default_config(out_dim: int, in_dim: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): the fastest of a sweep over BLOCK_N 4..16, BLOCK_K 512/1024 and 2..8 warps at
    the 7B projections in a CUDA graph on an H200 (see the module docstring)."""
    if in_dim > 4096:  # down
        return 4, 1024, 2
    if out_dim <= 4096:  # o
        return 8, 1024, 4
    return 4, 512, 2  # qkv, gate_up


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Triton: as `linear_torch` for x of one row ([1, K], contiguous). weight: [N, K] with contiguous rows.
    config: (BLOCK_N, BLOCK_K, num_warps), else `default_config`."""
    if x.device.type != "cuda" and not is_interpreted():
        raise RuntimeError("the Triton GEMV off CUDA needs TRITON_INTERPRET=1 before kubelora.kernels loads")
    out_dim, in_dim = weight.shape
    assert x.shape == (1, in_dim) and x.stride(1) == 1, (x.shape, weight.shape)
    assert x.dtype == weight.dtype and weight.stride(1) == 1
    assert bias is None or (bias.shape == (out_dim,) and bias.stride(0) == 1)
    y = torch.empty((1, out_dim), dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps = config or default_config(out_dim, in_dim)
    _gemv_kernel[(triton.cdiv(out_dim, block_n),)](
        x, weight, weight if bias is None else bias, y, out_dim, in_dim, weight.stride(0), HAS_BIAS=bias is not None,
        EVEN_K=in_dim % block_k == 0, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps)
    return y
