"""The single-row Triton GEMV (kernels/gemv.py) against the exact product and its reference (F.linear).

On CPU under TRITON_INTERPRET=1 at small sizes: float16 and float32 (the interpreter truncates float32 ->
bfloat16, so bfloat16 is checked within two ulps there), sizes off the blocks, bias. The `gpu` tests run the
Llama-2-7B projections in bfloat16, under CUDA-graph replay too.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def gemv():
    from kubelora.kernels import gemv

    if not HAS_CUDA and not gemv.is_interpreted():
        gemv = importlib.reload(sys.modules["kubelora.kernels.gemv"])
    return gemv


def check(out: torch.Tensor, x, w, b, ulps: float, is_product_rounded: bool = False) -> None:
    """Within `ulps` of the result's dtype, plus a thousandth of an ulp of the terms summed (float32 sums in any
    order): the kernel rounds once, from float32. is_product_rounded: the product x W^T was rounded to the dtype
    before the bias was added (a second rounding, relative to the product's size)."""
    product = x.double() @ w.double().T
    exact = product + (0 if b is None else b.double())
    magnitude = x.double().abs() @ w.double().abs().T
    scale = exact.abs() + (product.abs() if is_product_rounded else 0) + 1e-3 * magnitude
    bound = ulps * torch.finfo(out.dtype).eps * scale + 1e-6
    err = (out.double() - exact).abs()
    assert (err <= bound).all(), f"worst {(err / bound).max().item():.2f} of the bound"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
def test_matches_the_exact_product(gemv, dtype):
    gen = torch.Generator().manual_seed(0)
    n, k = 37, 80  # neither a multiple of the blocks: masked columns and a masked K tail
    x = torch.randn(1, k, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=gen) * 0.1).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE)
    ulps = 2.0 if dtype == torch.bfloat16 and not HAS_CUDA else 1.0  # the interpreter truncates to bfloat16
    for bias in (None, b):
        for config in ((8, 32, 4), (16, 64, 2), (4, 16, 1)):  # K tails of 16 and 16, and none
            out = gemv.linear(x, w, bias, config=config)
            assert out.shape == (1, n) and out.dtype == dtype
            check(out, x, w, bias, ulps)
        # The reference is cuBLAS on CUDA: in bfloat16 its bias epilogue adds the bias to the product already
        # rounded to bfloat16 (seen on H100 and H200, with or without reduced-precision reductions), two roundings.
        is_rounded_twice = HAS_CUDA and dtype == torch.bfloat16 and bias is not None
        check(gemv.linear_torch(x, w, bias), x, w, bias, 2.0, is_product_rounded=is_rounded_twice)


def test_shapes_are_checked(gemv):
    w = torch.randn(24, 64, dtype=torch.float16, device=DEVICE)
    with pytest.raises(AssertionError):
        gemv.linear(torch.randn(2, 64, dtype=torch.float16, device=DEVICE), w)  # one row only
    with pytest.raises(AssertionError):
        gemv.linear(torch.randn(1, 48, dtype=torch.float16, device=DEVICE), w)  # K differs
    assert gemv.default_config(4096, 11008) == (4, 1024, 2) and gemv.default_config(12288, 4096) == (4, 512, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="the 7B shapes in bfloat16 need a GPU")
@pytest.mark.parametrize("shape", [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)])
def test_7b_projections_and_graph_replay(gemv, shape):
    n, k = shape
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    out = gemv.linear(x, w)
    check(out, x, w, None, 1.0)
    assert (out != gemv.linear_torch(x, w)).double().mean().item() < 0.05  # cuBLAS sums in another order
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = gemv.linear(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, gemv.linear(x, w))
