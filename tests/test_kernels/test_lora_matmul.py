"""A decode step's projection with its LoRA expands in one launch (kernels/lora_matmul.py) against the float64
expectation of F.linear plus the step's deltas, and which steps take it. Under the CPU interpreter in float32."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from lora_problems import TOLERANCE, build_problem, expected_y

from kubelora.kernels.lora import prepare_lora_step

DTYPE = torch.bfloat16 if torch.cuda.is_available() else torch.float32
# (tokens, ranks per adapter and slice, slice widths, in_dim, distribution, share of tokens without an adapter,
#  launch config "n,k,stages,warps")
CASES = [
    (7, [[8, 4, 4], [16, 0, 3]], [64, 32, 32], 64, "uniform", 0.3, "32,32,1,4"),  # GQA widths; k of 1 not adapted
    (12, [[5], [16], [40], [1], [9]], [64], 96, "distinct", 0.2, "32,32,1,4"),  # 5 tiles over 3 K iterations
    (16, [[16, 16], [0, 24]], [128, 128], 128, "zipf", 0.0, "64,128,2,4"),  # gate/up; one K iteration
    (3, [[0, 8, 0]], [32, 32, 32], 32, "one", 0.0, "32,32,1,4"),  # only k adapted (q, v not in t)
    (40, [[8], [4]], [64], 64, "segments", 0.1, "32,32,1,4"),  # an adapter's tokens over several tiles
]


def matmul_module():
    return sys.modules["kubelora.kernels.lora_matmul"]


def build(case, device, with_bias, seed=0):
    num_tokens, ranks, widths, in_dim, dist, no_adapter, _ = case
    p = build_problem(num_tokens, ranks, widths, in_dim, dist, DTYPE, seed, device, no_adapter)
    gen = torch.Generator().manual_seed(seed + 1)
    weight = (torch.randn(sum(widths), in_dim, generator=gen) / in_dim**0.5).to(device, DTYPE)
    bias = torch.randn(sum(widths), generator=gen).to(device, DTYPE) if with_bias else None
    return p, weight, bias


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}tok-{len(c[1])}ad-{c[4]}")
def test_matmul_lora_matches_linear_plus_deltas(triton_backend, device, monkeypatch, case, with_bias):
    mod = matmul_module()
    monkeypatch.setenv(mod.CONFIG_ENV, case[-1])
    p, weight, bias = build(case, device, with_bias)
    assert mod.is_matmul_expand(p.x, weight, p.lora_b, p.proj, p.step)
    y = mod.matmul_lora(p.x, weight, bias, p.lora_a, p.lora_b, p.proj, p.step)
    base = F.linear(p.x.double(), weight.double(), None if bias is None else bias.double())
    p.y0 = base
    want = expected_y(p)
    err = (y.double() - want).norm(dim=1) / want.norm(dim=1)
    assert float(err.max()) <= TOLERANCE[DTYPE], float(err.max())
    ref = mod.matmul_lora_torch(p.x, weight, bias, p.lora_a, p.lora_b, p.proj, p.step)
    ref_err = (ref.double() - want).norm(dim=1) / want.norm(dim=1)
    assert float(err.max()) <= 2 * float(ref_err.max()) + TOLERANCE[DTYPE] / 10


def test_tokens_without_adapter_get_the_plain_matmul(triton_backend, device, monkeypatch):
    mod = matmul_module()
    case = CASES[0]
    monkeypatch.setenv(mod.CONFIG_ENV, case[-1])
    p, weight, bias = build(case, device, True, seed=3)
    y = mod.matmul_lora(p.x, weight, bias, p.lora_a, p.lora_b, p.proj, p.step)
    plain = F.linear(p.x, weight, bias)
    rows = torch.tensor(p.slots, device=device) < 0
    assert rows.any()
    limit = 1e-5 if DTYPE == torch.float32 else 1e-2
    assert torch.allclose(y[rows].float(), plain[rows].float(), rtol=limit, atol=limit)
    # a slice no adapter of the step adapts (k of adapter 1 is rank 0, but adapter 0 adapts it): every token
    # of adapter 1 keeps the plain k columns
    k_cols = slice(64, 96)
    of_1 = torch.tensor(p.slots, device=device) == 1
    assert torch.allclose(y[of_1, k_cols].float(), plain[of_1, k_cols].float(), rtol=limit, atol=limit)


def test_which_steps_take_the_fused_launch(triton_backend, device, monkeypatch):
    mod = matmul_module()
    case = CASES[0]
    monkeypatch.setenv(mod.CONFIG_ENV, case[-1])
    p, weight, _ = build(case, device, False)
    assert mod.is_matmul_expand(p.x, weight, p.lora_b, p.proj, p.step)
    monkeypatch.setenv(mod.CONFIG_ENV, "0")
    assert not mod.is_matmul_expand(p.x, weight, p.lora_b, p.proj, p.step), "turned off"
    monkeypatch.setenv(mod.CONFIG_ENV, "64,32,1,4")
    assert not mod.is_matmul_expand(p.x, weight, p.lora_b, p.proj, p.step), "k width 32 not a multiple of 64"
    monkeypatch.setenv(mod.CONFIG_ENV, case[-1])
    tall = prepare_lora_step([0] * 30 + [1] * 20, 2, device, tile_heights=(32,))
    x50 = torch.randn(50, case[3], device=device, dtype=DTYPE)
    assert not mod.is_matmul_expand(x50, weight, p.lora_b, p.proj, tall), '32-row tiles'
    many = prepare_lora_step([0, 1] * 40, 2, device)
    x80 = torch.randn(80, case[3], device=device, dtype=DTYPE)
    assert not mod.is_matmul_expand(x80, weight, p.lora_b, p.proj, many), "more tokens than MAX_TOKENS"
    none = prepare_lora_step([-1] * 4, 2, device)
    assert not mod.is_matmul_expand(p.x[:4], weight, p.lora_b, p.proj, none), "no adapter in the step"
