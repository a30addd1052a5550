"""The LoRA kernels on a decode step laid out for CUDA graphs (DecodeInputs: a fixed tile count per bucket,
empty tiles on a rank-0 pad slot, rank lanes fixed by the graph's key) give the reference's result on the
step's real layout (prepare_lora_step)."""

from __future__ import annotations

import pytest
import torch

from kubelora.engine.step.decode import DecodeInputs, DecodeStep
from kubelora.kernels.lora import add_lora_torch, prepare_lora_proj, prepare_lora_step

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

    inputs = DecodeInputs(max_seqs=32, max_blocks=2, block_size=16, pad_block=5, kind_slices={"qkv": 3},
                          device=torch.device(device))
    decode = DecodeStep(token_ids=[1] * num, positions=[0] * num, block_tables=[(0,)] * num, token_slots=slots,
                        slot_tables={"qkv": (row_start, ranks, scale)})
    key = decode.shape(bucket).lora
    inputs.fill(decode, decode.shape(bucket))
    got = y.clone()
    triton_backend.add_lora_triton(got, x, lora_a, lora_b, inputs.lora_projs(key)["qkv"], inputs.lora_step(bucket, key))
    torch.testing.assert_close(got[:num], expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[num:], y[num:])  # padded rows untouched
