"""kernels/fp8.py: the dequantizing reference against compressed-tensors' own dequantization (partial blocks
included) and, on the GPU, the scaled FP8 matmul against the reference."""

from __future__ import annotations

import pytest
import torch

from kubelora.kernels.fp8 import FP8, dequantize, fp8_linear, fp8_linear_torch

# (strategy, block): compressed-tensors' weight strategies, with the block of the block strategy
STRATEGIES = [("tensor", None), ("channel", None), ("block", (128, 128))]


def _quantized(shape: tuple[int, int], strategy: str, block, seed: int = 0):
    """(FP8 values, float32 scale grid, grid block, compressed-tensors' args) of a random weight."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize

    out_dim, in_dim = shape
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    args = QuantizationArgs(num_bits=8, type="float", strategy=strategy, block_structure=list(block) if block else None)
    if strategy == "tensor":
        scale, grid_block = weight.abs().amax().reshape(1, 1) / 448, (out_dim, in_dim)
    elif strategy == "channel":
        scale, grid_block = weight.abs().amax(1, keepdim=True) / 448, (1, in_dim)
    else:
        grid = torch.zeros(-(-out_dim // block[0]), -(-in_dim // block[1]))
        for i in range(grid.shape[0]):
            for j in range(grid.shape[1]):
                grid[i, j] = weight[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]].abs().amax()
        scale, grid_block = grid / 448, block
    q = quantize(weight, scale if strategy != "tensor" else scale.reshape(1), torch.zeros_like(scale), args, dtype=FP8)
    return q, scale, grid_block, args


@pytest.mark.parametrize(("strategy", "block"), STRATEGIES)
def test_dequantize_equals_compressed_tensors(strategy, block):
    from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize

    q, scale, grid_block, args = _quantized((320, 200), strategy, block)  # partial blocks on both axes
    expected = ct_dequantize(q, scale if strategy != "tensor" else scale.reshape(1), args=args, dtype=torch.float32)
    assert torch.equal(dequantize(q, scale, grid_block, torch.float32), expected)


def test_off_cuda_the_op_is_its_reference():
    q, scale, block, _ = _quantized((64, 96), "channel", None)
    x, bias = torch.randn(5, 96), torch.randn(64)
    assert torch.equal(fp8_linear(x, q, scale, block, bias), fp8_linear_torch(x, q, scale, block, bias))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
@pytest.mark.parametrize(("strategy", "block", "activations"), [
    ("tensor", None, "static-tensor"), ("channel", None, "dynamic-token"), ("block", (128, 128), "dynamic-group")])
def test_cuda_scaled_mm_close_to_reference(strategy, block, activations, num_tokens):
    """bfloat16 inputs quantized to FP8 as the scheme says: within 3% of the output's range of the reference
    (weights dequantized, inputs not quantized)."""
    q, scale, grid_block, _ = _quantized((512, 384), strategy, block)
    q, scale = q.cuda(), scale.cuda()
    x = torch.randn(num_tokens, 384, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(512, device="cuda", dtype=torch.bfloat16)
    input_scale = (x.abs().amax().float() / 448).reshape(1) if activations == "static-tensor" else None
    got = fp8_linear(x, q, scale, grid_block, bias, activations, input_scale)
    expected = fp8_linear_torch(x.float(), q, scale, grid_block, bias.float())
    assert float((got.float() - expected).abs().max()) < 0.03 * float(expected.abs().max())
