"""Fused small ops (kernels/fused.py): the references against the engine's own math, the Triton ops against them.

On CPU the Triton ops run under TRITON_INTERPRET=1 at small sizes in float32, float16 and bfloat16. The
interpreter truncates float32 -> bfloat16 where the GPU rounds to nearest even, so on CPU bfloat16 is only
checked within a few ulp; float16 (rounded to nearest even there too) carries the bit-level checks of every
rounding step. The `gpu` tests run the Llama-7B shapes in bfloat16, bit-level, and under CUDA-graph replay.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

HAS_CUDA = torch.cuda.is_available()
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Per dtype: (ulps against the reference, share of elements allowed to differ in any bit). 2 ulps: normed flips
# by 1 ulp where the float32 sum order or rsqrt tips a rounding, and the weight product rounds again. The share
# is what checks the rounding steps (a skipped one shows on ~20% of elements). float32 differs in reduction order
# and transcendental last bits, so its share is unbounded; interpreted bfloat16 truncates.
TOLERANCE = {torch.float32: (8, 1.0), torch.float16: (2, 1e-2),
             torch.bfloat16: (2, 1e-3) if HAS_CUDA else (4, 1.0)}


@pytest.fixture
def fused():
    """kubelora.kernels.fused, built for the interpreter when there is no GPU (see conftest.py)."""
    from kubelora.kernels import fused

    if not HAS_CUDA and not fused.is_interpreted():
        fused = importlib.reload(sys.modules["kubelora.kernels.fused"])
    return fused


def check_close(actual: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor | float = 0.0,
                max_share: float | None = None) -> None:
    """|actual - expected| <= ulps * eps * (|expected| + magnitude), and few elements differing at all.

    magnitude: the scale of the terms summed into an element (rotary: a sum of two rounded products can cancel).
    max_share: the share of elements that may differ (default: the dtype's in TOLERANCE).
    """
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    ulps, dtype_share = TOLERANCE[expected.dtype]
    max_share = dtype_share if max_share is None else max_share
    eps = torch.finfo(expected.dtype).eps
    a, e = actual.double(), expected.double()
    err = (a - e).abs()
    bound = ulps * eps * (e.abs() + magnitude) + torch.finfo(expected.dtype).tiny
    share = (actual != expected).double().mean().item()
    worst = (err / bound).max().item()
    assert worst <= 1.0 and share <= max_share, f"worst {worst:.2f} of the bound, {share:.2e} of elements differ"


def hidden_states(num_tokens: int, width: int, dtype: torch.dtype, device, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(num_tokens, width, generator=g) * 3).to(device=device, dtype=dtype)


# ---- references: the engine's math, bit for bit ---------------------------------------------------------------


def _transformers_norm(is_unit_offset: bool, dim: int, weight: torch.Tensor):
    """transformers' RMSNorm of Llama (w x) or Gemma (x (1 + w)), holding `weight`."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    module = (Gemma2RMSNorm if is_unit_offset else LlamaRMSNorm)(dim, eps=1e-6).to(weight.dtype)
    module.weight.data.copy_(weight)
    return module


@pytest.mark.parametrize("is_unit_offset", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rms_norm_reference_is_transformers(fused, dtype, is_unit_offset):
    x, residual = hidden_states(5, 96, dtype, "cpu", 1), hidden_states(5, 96, dtype, "cpu", 2)
    weight = hidden_states(1, 96, dtype, "cpu", 3)[0]
    norm = _transformers_norm(is_unit_offset, 96, weight)
    hidden = residual + x  # transformers' `hidden = residual + hidden`
    with torch.no_grad():
        normed, summed = fused.add_rms_norm_torch(x, residual, weight, 1e-6, is_unit_offset=is_unit_offset)
        assert torch.equal(summed, hidden) and torch.equal(normed, norm(hidden))
        alone = fused.add_rms_norm_torch(x, None, weight, 1e-6, is_unit_offset=is_unit_offset)[0]
        assert torch.equal(alone, norm(x))


@pytest.mark.parametrize("is_unit_offset", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_head_rms_norm_reference_is_transformers(fused, dtype, is_unit_offset):
    """Qwen3's and Gemma 3's q/k norms: one RMSNorm over head_dim per head, on a view of the fused projection."""
    qkv = hidden_states(5, 3 * 4 * 32, dtype, "cpu", 4)
    q = qkv[:, : 4 * 32].view(5, 4, 32)
    weight = hidden_states(1, 32, dtype, "cpu", 5)[0]
    with torch.no_grad():
        expected = _transformers_norm(is_unit_offset, 32, weight)(q.clone())
    fused.head_rms_norm_torch_(q, weight, 1e-6, is_unit_offset=is_unit_offset)
    assert torch.equal(qkv[:, : 4 * 32].view(5, 4, 32), expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_tanh_mul_reference_is_transformers(fused, dtype):
    from transformers.activations import ACT2FN

    gate_up = hidden_states(5, 2 * 96, dtype, "cpu", 6)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(fused.gelu_tanh_mul_torch(gate_up), ACT2FN["gelu_pytorch_tanh"](gate) * up)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_reference_is_the_engines(fused, dtype):
    from kubelora.engine.model.rope import RotaryEmbedding, apply_rotary

    q, k, _, positions, inv_freq = rotary_problem(7, 4, 2, 32, dtype, "cpu", max_position=4096)
    rope = RotaryEmbedding(inv_freq, 0.8, torch.device("cpu"))
    cos, sin = rope.cos_sin(positions, dtype)
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    fused.rotary_torch_(q, k, positions, inv_freq, 0.8)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)


# ---- add_rms_norm ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("is_unit_offset", [False, True])
@pytest.mark.parametrize("has_residual", [True, False])
@pytest.mark.parametrize("hidden", [96, 200, 64])
@pytest.mark.parametrize("num_tokens", [1, 7])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rms_norm_matches_reference(fused, device, dtype, num_tokens, hidden, has_residual, is_unit_offset):
    x = hidden_states(num_tokens, hidden, dtype, device, hidden)
    residual = hidden_states(num_tokens, hidden, dtype, device, hidden + 1) if has_residual else None
    weight = hidden_states(1, hidden, dtype, device, hidden + 2)[0]
    normed, summed = fused.add_rms_norm(x, residual, weight, 1e-5, is_unit_offset=is_unit_offset)
    expected_normed, expected_summed = fused.add_rms_norm_torch(x, residual, weight, 1e-5,
                                                                is_unit_offset=is_unit_offset)
    check_sum(summed, expected_summed)
    check_close(normed, expected_normed)


def check_sum(summed: torch.Tensor, expected: torch.Tensor) -> None:
    """x + residual is one rounding: bit-equal wherever the float32 -> dtype cast rounds to nearest even."""
    if HAS_CUDA or summed.dtype != torch.bfloat16:
        assert torch.equal(summed, expected)
    else:
        check_close(summed, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rms_norm_in_place_into_strided_rows(fused, device, dtype):
    """x a column slice of a wider tensor; residual updated in place; normed written into a preallocated view."""
    wide = hidden_states(6, 300, dtype, device, 4)
    x, residual = wide[:, 50:250], hidden_states(6, 200, dtype, device, 5)
    weight = hidden_states(1, 200, dtype, device, 6)[0]
    expected_normed, expected_summed = fused.add_rms_norm_torch(x, residual.clone(), weight, 1e-6)
    out_buffer = torch.full((6, 256), float("nan"), dtype=dtype, device=device)
    normed, summed = fused.add_rms_norm(x, residual, weight, 1e-6, out=out_buffer[:, :200], residual_out=residual)
    assert summed.data_ptr() == residual.data_ptr() and normed.data_ptr() == out_buffer.data_ptr()
    check_sum(residual, expected_summed)
    check_close(normed, expected_normed)
    assert out_buffer[:, 200:].isnan().all(), "wrote past the row's hidden columns"


def test_add_rms_norm_float32_weight_promotes(fused, device):
    """A float32 weight on bfloat16 states: out in float32, as `weight * x32.to(x.dtype)` promotes."""
    x = hidden_states(3, 96, torch.bfloat16, device, 7)
    weight = hidden_states(1, 96, torch.float32, device, 8)[0]
    normed, _ = fused.add_rms_norm(x, None, weight, 1e-6)
    expected, _ = fused.add_rms_norm_torch(x, None, weight, 1e-6)
    assert normed.dtype == torch.float32
    torch.testing.assert_close(normed, expected, rtol=2 * torch.finfo(torch.bfloat16).eps, atol=0)


# ---- silu_mul and gelu_tanh_mul --------------------------------------------------------------------------------


@pytest.mark.parametrize("inter", [96, 200, 300, 1100])
@pytest.mark.parametrize("num_tokens", [1, 5, 70])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_matches_reference(fused, device, dtype, num_tokens, inter):
    """70 tokens take the 1024-column blocks, fewer the 256-column ones; 300 and 1100 leave a masked tail."""
    gate_up = hidden_states(num_tokens, 2 * inter, dtype, device, inter)
    check_close(fused.silu_mul(gate_up), fused.silu_mul_torch(gate_up))


@pytest.mark.parametrize("inter", [96, 300])
@pytest.mark.parametrize("num_tokens", [1, 70])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_tanh_mul_matches_reference(fused, device, dtype, num_tokens, inter):
    """Within ulps of |gate * up|: torch computes 0.5 x (1 + tanh(u)), which cancels where the gate is negative (a
    float32 ulp of 1, times x); the kernel's x / (1 + exp(-2u)) does not."""
    gate_up = hidden_states(num_tokens, 2 * inter, dtype, device, inter)
    gate, up = gate_up.chunk(2, dim=-1)
    check_close(fused.gelu_tanh_mul(gate_up), fused.gelu_tanh_mul_torch(gate_up), magnitude=(gate * up).abs().float(),
                max_share=max(TOLERANCE[dtype][1], 0.05))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
def test_gelu_tanh_mul_extremes(fused, device):
    """Very negative gates: gelu -> -0 without the 1 + tanh cancellation; large ones: the gate itself."""
    gate = torch.tensor([[-200.0, -12.0, -3.0, -1e-3, 0.0, 1e-3, 3.0, 200.0]], device=device)
    gate_up = torch.cat((gate, torch.ones_like(gate)), dim=-1)
    out = fused.gelu_tanh_mul(gate_up)
    torch.testing.assert_close(out, fused.gelu_tanh_mul_torch(gate_up), rtol=0, atol=1e-6)
    assert out[0, 0].item() == 0.0 and out[0, -1].item() == 200.0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_from_strided_rows_into_out(fused, device, dtype):
    wide = hidden_states(4, 2 * 200 + 24, dtype, device, 9)
    gate_up = wide[:, 8 : 8 + 400]
    out_buffer = torch.full((4, 256), float("nan"), dtype=dtype, device=device)
    out = fused.silu_mul(gate_up, out=out_buffer[:, :200])
    check_close(out, fused.silu_mul_torch(gate_up))
    assert out_buffer[:, 200:].isnan().all()


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's numpy exp, as intended
def test_silu_mul_extremes(fused, device):
    """Large |gate|: exp(-gate) overflows to inf for very negative gates, silu -> -0, as torch gives."""
    gate = torch.tensor([[-200.0, -90.0, -20.0, 0.0, 20.0, 90.0, 200.0, 1e-30]], device=device)
    gate_up = torch.cat((gate, torch.ones_like(gate)), dim=-1)
    out = fused.silu_mul(gate_up)
    torch.testing.assert_close(out, fused.silu_mul_torch(gate_up), rtol=1e-6, atol=0)
    assert out.isfinite().all() and out[0, 0].item() == 0.0


# ---- rotary_ ---------------------------------------------------------------------------------------------------


def rotary_problem(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device, max_position, seed=0):
    """(q, k, v, positions, inv_freq); q, k, v as the engine gets them: strided views of a fused
    [num_tokens, (H + 2 * KVH) * D] qkv output."""
    qkv = hidden_states(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype, device, seed)
    q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_dim, kv_dim, kv_dim], dim=-1)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    positions = torch.randint(0, max_position, (num_tokens,), generator=g).to(device)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    views = [t.view(num_tokens, n, head_dim) for t, n in ((q, num_heads), (k, num_kv_heads), (v, num_kv_heads))]
    return (*views, positions, inv_freq.to(device))


def check_rotary(fused, q, k, v, positions, inv_freq, scaling) -> None:
    """rotary_ against rotary_torch_ on copies, within the magnitude of each head's elements; v untouched."""
    expected_q, expected_k, v_before = q.clone(), k.clone(), v.clone()
    fused.rotary_torch_(expected_q, expected_k, positions, inv_freq, scaling)
    magnitudes = [x.abs().amax(-1, keepdim=True).double() * scaling for x in (q, k)]
    fused.rotary_(q, k, positions, inv_freq, scaling)
    # On CUDA the angles' cos/sin come from Triton's device functions, whose last float32 bits differ from
    # torch's at large angles: rounding to the dtype then flips on up to a quarter of the elements, each within
    # the ulp bound (H200, 2026-12-01: worst 0.28 of the bound, 26% of 16-bit elements). Only the bound holds.
    share = 1.0 if q.is_cuda else None
    check_close(q, expected_q, magnitudes[0], share)
    check_close(k, expected_k, magnitudes[1], share)
    assert torch.equal(v, v_before), "wrote into v"


@pytest.mark.parametrize("shape", [(1, 4, 2, 16), (9, 4, 4, 64), (70, 6, 2, 24), (3, 1, 1, 128)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_matches_reference(fused, device, dtype, shape):
    """70 tokens take 4-head programs (6 heads: a masked block); head_dim 24 masks a 16-wide half block."""
    num_tokens, num_heads, num_kv_heads, head_dim = shape
    q, k, v, positions, inv_freq = rotary_problem(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device,
                                                  max_position=4096, seed=num_tokens)
    check_rotary(fused, q, k, v, positions, inv_freq, 1.0 if num_tokens % 2 else 0.75)


def test_rotary_int32_positions_and_contiguous_qk(fused, device):
    q, k, v, positions, inv_freq = rotary_problem(5, 2, 2, 32, torch.float32, device, max_position=4096)
    check_rotary(fused, q.contiguous(), k.contiguous(), v, positions.int(), inv_freq, 1.0)


def cache_problem(num_tokens, num_kv_heads, head_dim, dtype, device, block_size=4, seed=0):
    """(key_cache, value_cache, slot_mapping): random caches, distinct slots spread over the blocks, the last -1."""
    num_blocks = num_tokens // block_size + 3
    g = torch.Generator(device="cpu").manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache, value_cache = (torch.randn(shape, generator=g).to(dtype).to(device) for _ in range(2))
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    if num_tokens > 1:
        slots[-1] = -1
    return key_cache, value_cache, slots.to(device)


@pytest.mark.parametrize("shape", [(1, 4, 2, 16), (9, 4, 4, 64), (70, 6, 2, 24), (3, 1, 1, 128)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_kv_cache_matches_reference(fused, device, dtype, shape):
    check_rotary_kv_cache(fused, device, dtype, shape, block_size=4)


def check_rotary_kv_cache(fused, device, dtype, shape, block_size):
    """q rotated as rotary_ rotates it; the rotated k and v land at their slots (none for slot -1); every other
    cache slot, k and v keep their bits."""
    num_tokens, num_heads, num_kv_heads, head_dim = shape
    q, k, v, positions, inv_freq = rotary_problem(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device,
                                                  max_position=4096, seed=num_tokens)
    key_cache, value_cache, slots = cache_problem(num_tokens, num_kv_heads, head_dim, dtype, device, block_size,
                                                  seed=num_tokens)
    expected = [t.clone() for t in (q, key_cache, value_cache)]
    k_before, v_before = k.clone(), v.clone()
    fused.rotary_kv_cache_torch_(*expected[:1], k, v, positions, inv_freq, 0.75, *expected[1:], slots)
    assert torch.equal(k, k_before) and torch.equal(v, v_before), "the reference wrote into k or v"
    rotated_q, rotated_k = q.clone(), k.clone()
    fused.rotary_torch_(rotated_q, rotated_k, positions, inv_freq, 0.75)
    kept = slots >= 0
    flat = (num_kv_heads, head_dim)
    assert torch.equal(expected[0], rotated_q)
    assert torch.equal(expected[1].view(-1, *flat)[slots[kept]], rotated_k[kept])
    assert torch.equal(expected[2].view(-1, *flat)[slots[kept]], v[kept])

    magnitude_q = q.abs().amax(-1, keepdim=True).double() * 0.75
    magnitude_k = k.abs().amax(-1, keepdim=True).double() * 0.75
    fused.rotary_kv_cache_(q, k, v, positions, inv_freq, 0.75, key_cache, value_cache, slots)
    share = 1.0 if q.is_cuda else None
    check_close(q, expected[0], magnitude_q, share)
    assert torch.equal(k, k_before) and torch.equal(v, v_before), "wrote into k or v"
    written = torch.zeros(key_cache.shape[0] * key_cache.shape[1], dtype=torch.bool)
    written[slots[kept].cpu()] = True
    written = written.to(device)
    assert torch.equal(key_cache.view(-1, *flat)[~written], expected[1].view(-1, *flat)[~written])
    assert torch.equal(value_cache.view(-1, *flat), expected[2].view(-1, *flat)), "v is copied bit for bit"
    check_close(key_cache.view(-1, *flat)[slots[kept]], expected[1].view(-1, *flat)[slots[kept]],
                magnitude_k[kept], share)


@pytest.mark.parametrize("is_unit_offset", [False, True])
@pytest.mark.parametrize("shape", [(9, 4, 2, 32), (70, 6, 2, 24)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_kv_cache_with_head_norms_matches_reference(fused, device, dtype, shape, is_unit_offset):
    """Qwen3's and Gemma 3's q/k norms inside the rotary launch: each head normed (rounded to the dtype), then
    rotated; q in place, k into the cache; 24 leaves masked columns in each half."""
    num_tokens, num_heads, num_kv_heads, head_dim = shape
    q, k, v, positions, inv_freq = rotary_problem(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device,
                                                  max_position=4096, seed=head_dim)
    key_cache, value_cache, slots = cache_problem(num_tokens, num_kv_heads, head_dim, dtype, device, seed=head_dim)
    weights = hidden_states(2, head_dim, dtype, device, head_dim + 1) * 0.3
    norms = fused.HeadNorms(weights[0], weights[1], 1e-6, is_unit_offset)
    expected = [t.clone() for t in (q, key_cache, value_cache)]
    fused.rotary_kv_cache_torch_(expected[0], k, v, positions, inv_freq, 0.75, *expected[1:], slots, norms=norms)
    normed_q, normed_k = q.clone(), k.clone()
    fused.head_rms_norm_torch_(normed_q, norms.q_weight, 1e-6, is_unit_offset)
    fused.head_rms_norm_torch_(normed_k, norms.k_weight, 1e-6, is_unit_offset)
    magnitude_q = normed_q.abs().amax(-1, keepdim=True).double() * 0.75
    magnitude_k = normed_k.abs().amax(-1, keepdim=True).double() * 0.75
    fused.rotary_torch_(normed_q, normed_k, positions, inv_freq, 0.75)
    kept = slots >= 0
    flat = (num_kv_heads, head_dim)
    assert torch.equal(expected[0], normed_q)
    assert torch.equal(expected[1].view(-1, *flat)[slots[kept]], normed_k[kept])

    k_before = k.clone()
    fused.rotary_kv_cache_(q, k, v, positions, inv_freq, 0.75, key_cache, value_cache, slots, norms=norms)
    assert torch.equal(k, k_before), "wrote into k"
    share = 1.0 if q.is_cuda else None
    check_close(q, expected[0], magnitude_q, share)
    check_close(key_cache.view(-1, *flat)[slots[kept]], expected[1].view(-1, *flat)[slots[kept]],
                magnitude_k[kept], share)
    assert torch.equal(value_cache, expected[2])


def test_zero_tokens(fused, device):
    x = torch.empty(0, 64, device=device)
    normed, summed = fused.add_rms_norm(x, x, torch.ones(64, device=device), 1e-6)
    assert normed.shape == summed.shape == (0, 64)
    assert fused.silu_mul(torch.empty(0, 128, device=device)).shape == (0, 64)
    q, k, v, positions, inv_freq = rotary_problem(0, 2, 1, 16, torch.float32, device, max_position=16)
    fused.rotary_(q, k, positions, inv_freq, 1.0)
    key_cache, value_cache, slots = cache_problem(0, 1, 16, torch.float32, device)
    fused.rotary_kv_cache_(q, k, v, positions, inv_freq, 1.0, key_cache, value_cache, slots)


# ---- GPU: Llama-7B shapes in bfloat16, CUDA graphs -------------------------------------------------------------

LLAMA_7B = {"hidden": 4096, "inter": 11008, "num_heads": 32, "head_dim": 128}


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 257, 2048])
def test_gpu_llama_7b_bf16(fused, num_tokens):
    hidden, inter = LLAMA_7B["hidden"], LLAMA_7B["inter"]
    x, residual = (hidden_states(num_tokens, hidden, torch.bfloat16, "cuda", s) for s in (1, 2))
    weight = hidden_states(1, hidden, torch.bfloat16, "cuda", 3)[0]
    normed, summed = fused.add_rms_norm(x, residual, weight, 1e-5)
    expected_normed, expected_summed = fused.add_rms_norm_torch(x, residual, weight, 1e-5)
    assert torch.equal(summed, expected_summed)
    check_close(normed, expected_normed)
    gate_up = hidden_states(num_tokens, 2 * inter, torch.bfloat16, "cuda", 4)
    check_close(fused.silu_mul(gate_up), fused.silu_mul_torch(gate_up))
    for num_kv_heads in (32, 8):  # Llama-2-7B, and a GQA layout
        q, k, v, positions, inv_freq = rotary_problem(num_tokens, 32, num_kv_heads, 128, torch.bfloat16, "cuda",
                                                      max_position=4096, seed=5)
        check_rotary(fused, q, k, v, positions, inv_freq, 1.0)
        check_rotary_kv_cache(fused, "cuda", torch.bfloat16, (num_tokens, 32, num_kv_heads, 128), block_size=16)


@pytest.mark.gpu
def test_gpu_rotary_angles_at_long_positions(fused):
    """float32 at positions up to 2^20: the kernel's cos/sin reduce large angles as accurately as torch's."""
    q, k, _, positions, inv_freq = rotary_problem(512, 32, 8, 128, torch.float32, "cuda", max_position=1 << 20)
    expected_q, expected_k = q.clone(), k.clone()
    fused.rotary_torch_(expected_q, expected_k, positions, inv_freq, 1.0)
    fused.rotary_(q, k, positions, inv_freq, 1.0)
    torch.testing.assert_close(q, expected_q, rtol=0, atol=1e-5 * expected_q.abs().max().item())
    torch.testing.assert_close(k, expected_k, rtol=0, atol=1e-5 * expected_k.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64])
def test_gpu_graph_replay_equals_eager(fused, num_tokens):
    """All three ops captured in one CUDA graph over static buffers; replayed on new inputs, bit-equal to eager."""
    hidden, inter = LLAMA_7B["hidden"], LLAMA_7B["inter"]
    x, residual = (hidden_states(num_tokens, hidden, torch.bfloat16, "cuda", s) for s in (1, 2))
    weight = hidden_states(1, hidden, torch.bfloat16, "cuda", 3)[0]
    gate_up = hidden_states(num_tokens, 2 * inter, torch.bfloat16, "cuda", 4)
    q, k, _, positions, inv_freq = rotary_problem(num_tokens, 32, 32, 128, torch.bfloat16, "cuda", 4096)
    normed, summed = torch.empty_like(x), torch.empty_like(x)
    out = torch.empty(num_tokens, inter, dtype=torch.bfloat16, device="cuda")

    def step():
        fused.add_rms_norm(x, residual, weight, 1e-5, out=normed, residual_out=summed)
        fused.silu_mul(gate_up, out=out)
        fused.rotary_(q, k, positions, inv_freq, 1.0)

    step()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    inputs = [x, residual, gate_up, q, k]
    new_inputs = [torch.randn_like(t) for t in inputs]
    new_positions = torch.randint_like(positions, 0, 4096)
    for buffer, new in zip(inputs, new_inputs):
        buffer.copy_(new)
    positions.copy_(new_positions)
    graph.replay()
    replayed = [t.clone() for t in (normed, summed, out, q, k)]
    for buffer, new in zip(inputs, new_inputs):
        buffer.copy_(new)
    step()
    for got, eager in zip(replayed, (normed, summed, out, q, k)):
        assert torch.equal(got, eager)


@pytest.mark.skipif(HAS_CUDA, reason="--smoke is the CPU interpreter's path; the GPU runs the benchmark itself")
def test_bench_runs_in_smoke_mode(fused, tmp_path, monkeypatch):
    """bench/fused.py end to end on tiny shapes under the interpreter: one row per op, size and implementation."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # main sets it; restored after the test
    spec = importlib.util.spec_from_file_location("bench_fused", Path(__file__).parents[2] / "bench" / "fused.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up there
    try:
        spec.loader.exec_module(bench)
        assert bench.main(["--smoke", "--out", str(tmp_path / "fused.md")]) == 0
    finally:
        del sys.modules[spec.name]
    lines = (tmp_path / "fused.md").read_text().splitlines()
    rows = [line.split(" | ") for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 2 * 3 * 2 and {row[2] for row in rows} == {"triton", "torch"}
