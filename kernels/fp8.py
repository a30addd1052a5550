"""Linear layers over FP8 weights: float8_e4m3fn values with float32 scales on a grid of weight blocks.

    y = x (q * S)^T + b,    S[r, c] = scale[r // block[0], c // block[1]]

x: [num_tokens, in_dim] in the activation dtype; q: [out_dim, in_dim] float8_e4m3fn; scale: [ceil(out_dim /
block[0]), ceil(in_dim / block[1])] float32; bias: [out_dim] or None. A per-tensor weight is one block ([1, 1] grid,
block (out_dim, in_dim)), a per-channel one a column of blocks ([out_dim, 1], block (1, in_dim)), a block-wise one
(128, 128) blocks. A partial last block keeps its scale (the grid is rounded up).

`fp8_linear_torch` is the reference and the path off CUDA: the weight dequantized to x's dtype on each call, x
unquantized. On CUDA with bfloat16 activations `fp8_linear` quantizes x as the checkpoint says (`activations`: per
token, per token and group of columns, or with the checkpoint's static input scale) and runs torch's scaled matmul
on the FP8 tensor cores (row-wise scales through torch._scaled_mm, 128x128 blocks through
torch.nn.functional.scaled_mm); this path has not yet run on a GPU, and shapes it does not take fall back to the
reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
SCALED_MM_ALIGN = 16  # torch._scaled_mm: in_dim and out_dim multiples of 16


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """q * S as `dtype` [out_dim, in_dim]: the exact float32 product (an e4m3 value has 4 significant bits), rounded
    once to `dtype`, which is what multiplying in a float dtype holding the scale gives."""
    rows, cols = q.shape
    s = scale.to(torch.float32).repeat_interleave(block[0], 0)[:rows]
    if s.shape[1] > 1:  # blocks along the input too; one column broadcasts as it is
        s = s.repeat_interleave(block[1], 1)[:, :cols]
    return (q.to(torch.float32) * s).to(dtype)


def fp8_linear_torch(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None, activations: str = "dynamic-token",
                     input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: x (q * S)^T + b with the weight dequantized to x's dtype, x not quantized."""
    return F.linear(x, dequantize(q, scale, block, x.dtype), bias)


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None, activations: str = "dynamic-token",
               input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x (q * S)^T + b: the scaled FP8 matmul on CUDA where it takes the shape, else the reference.

    activations: "dynamic-token", "dynamic-group" or "static-tensor" (engine/model/config.py, ACTIVATION_SCHEMES);
    input_scale: the static scheme's float32 scale [1]."""
    if _takes_scaled_mm(x, q, scale, block):
        if scale.shape[1] == 1:
            return _rowwise_scaled_mm(x, q, scale, block, bias, activations, input_scale)
        return _blockwise_scaled_mm(x, q, scale, bias)
    return fp8_linear_torch(x, q, scale, block, bias, activations, input_scale)


def _takes_scaled_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> bool:
    """CUDA, bfloat16 output (row-wise scaling's only one), aligned dims; blocks: 128x128 whole ones."""
    out_dim, in_dim = q.shape
    if not (x.is_cuda and x.dtype == torch.bfloat16 and out_dim % SCALED_MM_ALIGN == 0
            and in_dim % SCALED_MM_ALIGN == 0):
        return False
    return scale.shape[1] == 1 or (tuple(block) == (128, 128) and out_dim % 128 == 0 and in_dim % 128 == 0)


def _quantize_rows(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] -> (e4m3 values, float32 scales [m, k // group]): one scale per row and group of columns."""
    m, k = x.shape
    groups = x.float().view(m, k // group, group)
    scale = groups.abs().amax(-1).clamp(min=1e-12) / FP8_MAX
    values = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(m, k)
    return values, scale


def _rowwise_scaled_mm(x, q, scale, block, bias, activations, input_scale) -> torch.Tensor:
    """Per-tensor or per-channel weights: one weight scale per output row, one input scale per token."""
    out_dim = q.shape[0]
    scale_b = scale.repeat_interleave(block[0], 0)[:out_dim].view(1, out_dim)
    if activations == "static-tensor":
        x_q = (x.float() / input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        scale_a = input_scale.view(1, 1).expand(x.shape[0], 1).contiguous()
    else:
        x_q, scale_a = _quantize_rows(x, x.shape[1])
    return torch._scaled_mm(x_q, q.t(), scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=x.dtype)


def _blockwise_scaled_mm(x, q, scale, bias) -> torch.Tensor:
    """128x128 weight blocks, inputs per token and 128 columns (DeepSeek-V3's recipe, cuBLASLt on SM90)."""
    x_q, scale_a = _quantize_rows(x, 128)
    # cuBLASLt reads the block scales outer-dim-major: transposed, contiguous
    y = F.scaled_mm(x_q, q.t(), scale_a.t().contiguous().t(), F.ScalingType.BlockWise1x128, scale.t().contiguous().t(),
                    F.ScalingType.BlockWise128x128, output_dtype=x.dtype)
    return y if bias is None else y + bias
