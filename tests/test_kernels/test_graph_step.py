"""The LoRA kernels on a decode step laid out for CUDA graphs (engine/step/inputs.py at a decode shape's extent: a
fixed tile count per bucket, empty tiles on a rank-0 pad slot, rank lanes fixed by the shape) give the reference's
result on the step's real layout (prepare_lora_step)."""

from __future__ import annotations

import pytest
import torch

from kubelora.engine.step.shape import decode_shape
from kubelora.kernels.lora import add_lora_torch, prepare_lora_proj, prepare_lora_step
from lora_problems import decode_inputs, decode_step

IN_DIM, WIDTHS = 64, [64, 32, 32]  # a GQA-shaped qkv: q 64 wide, k and v 32


def _pools(num_rows: int, device: str):
    gen = torch.Generator().manual_seed(0)
    lora_a = [torch.randn(num_rows, IN_DIM, generator=gen).to(device) for _ in WIDTHS]
    lora_b = [torch.randn(num_rows, w, generator=gen).to(device) * 0.1 for w in WIDTHS]
    return lora_a, lora_b


@pytest.mark.parametrize("slots,bucket", [
    ([0, -1, 1, 2, 1, -1, 0], 8),  # padded rows, base rows, one token per tile mostly
    ([0] * 18 + [1] * 3 + [-1], 24),  # one adapter over two tiles
    ([3, 2, 1, 0], 4),  # every row its own adapter
])
def test_graph_step_matches_reference(triton_backend, device, slots, bucket):
    ranks = [[8, 0, 8], [20, 20, 20], [4, 4, 0], [16, 16, 16]][: max(slots) + 1]
    row_start = [[0, 0, 0], [8, 8, 8], [28, 28, 28], [32, 32, 32]][: len(ranks)]
    scale = [[0.5, 0.5, 0.5], [2.0, 2.0, 2.0], [1.0, 1.0, 1.0], [0.25, 0.25, 0.25]][: len(ranks)]
    lora_a, lora_b = _pools(48, device)
    num = len(slots)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(bucket, IN_DIM, generator=gen).to(device)
    y = torch.randn(bucket, sum(WIDTHS), generator=gen).to(device)

    expected = y[:num].clone()
    step = prepare_lora_step(slots, len(ranks), device)
    add_lora_torch(expected, x[:num], lora_a, lora_b, prepare_lora_proj(row_start, ranks, scale, device), step)

    inputs = decode_inputs(device)
    decode = decode_step(slots, {"qkv": (row_start, ranks, scale)})
    extent = inputs.static_extent(decode_shape(bucket, slots, decode.slot_tables))
    inputs.fill(decode, extent)
    lora = inputs.context(extent, None).lora
    got = y.clone()
    triton_backend.add_lora_triton(got, x, lora_a, lora_b, lora.proj["qkv"], lora.step)
    torch.testing.assert_close(got[:num], expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[num:], y[num:])  # padded rows untouched
