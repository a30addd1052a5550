"""A decode step's LoRA expands done by the next op's launch (kernels/lora_delta.py, a `fused.LoRADelta`): the
residual add + RMSNorm (o) and the rotary with the KV-cache write (q, k, v), each against its reference; the
decode ops (shrink, then that launch) against `add_lora` followed by the plain op; which steps take them. Under
the CPU interpreter without a GPU."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from kubelora.kernels.lora import add_lora_torch, prepare_lora_proj, prepare_lora_step
from kubelora.kernels.lora_config import BLOCK_R

HAS_CUDA = torch.cuda.is_available()
# hidden (o's width), ranks of the adapters on o, the decode batch's slots (-1: no adapter)
NORM_CASES = [
    (200, [5, 0, 16], [0, -1, 2, 0, 1, 2, -1]),  # a rank-0 adapter; hidden not a power of two
    (64, [16, 3], [1, 1, 0, 1]),
    (96, [40], [0, -1, 0]),  # several rank chunks of t
]
# heads, kv heads, head_dim, ranks per adapter (q, k, v), the batch's slots
ROTARY_CASES = [
    (4, 2, 32, [[8, 8, 8], [16, 0, 4]], [0, 1, -1, 1, 0]),  # GQA; k not adapted by adapter 1
    (2, 2, 24, [[3, 5, 7]], [0, -1, 0]),  # halves of 12: padded columns
    (3, 1, 16, [[40, 2, 0], [1, 1, 1]], [1, 0, 1, -1, 0, 0]),  # rank 40: several chunks; v of adapter 0 rank 0
]


@pytest.fixture
def ops(triton_backend):
    """(fused, lora_delta), built for the interpreter when there is no GPU (see conftest.py)."""
    from kubelora.kernels import fused, lora_delta

    if not HAS_CUDA and not fused.is_interpreted():
        fused = importlib.reload(fused)
        lora_delta = importlib.reload(lora_delta)
    return fused, lora_delta


def pools(widths, num_adapters, in_dim, device, dtype, gen):
    rows = 64 * num_adapters + 8
    lora_a = [(torch.randn(rows, in_dim, generator=gen) / 7).to(device, dtype) for _ in widths]
    lora_b = [torch.randn(rows, w, generator=gen).to(device, dtype) for w in widths]
    return lora_a, lora_b


def random_delta(fused, step, proj, lora_b, t_cols, device):
    """A LoRADelta over a t drawn at random, NaN at and past each token's rank in its slice (never read)."""
    gen = torch.Generator().manual_seed(7)
    num_cols = max(t_cols) + 1
    lanes = -(-int(proj.rank.max()) // BLOCK_R) * BLOCK_R
    t = torch.randn(step.num_lora_tokens, num_cols, lanes, generator=gen)
    slots = step.token_slots[step.sorted_tokens].cpu()
    for s, c in enumerate(t_cols):
        if c >= 0:
            ranks = proj.rank[slots, s].cpu()
            t[:, c][torch.arange(lanes)[None, :] >= ranks[:, None]] = math.nan
    return fused.LoRADelta(t=t.to(device), t_cols=tuple(t_cols), b=tuple(lora_b), rows=step.token_rows,
                           slots=step.token_slots, rank=proj.rank, row_start=proj.row_start, scale=proj.scale)


def build_norm(case, device, dtype, seed=0):
    hidden, ranks, slots = case
    gen = torch.Generator().manual_seed(seed)
    step = prepare_lora_step(slots, len(ranks), device)
    lora_a, lora_b = pools([hidden], len(ranks), 48, device, dtype, gen)
    proj = prepare_lora_proj([[2 + 64 * a] for a in range(len(ranks))], [[r] for r in ranks],
                             [[0.5 + 0.25 * a] for a in range(len(ranks))], device)
    x = torch.randn(len(slots), 48, generator=gen).to(device, dtype)
    y = (torch.randn(len(slots), hidden, generator=gen) * 2).to(device, dtype)
    residual = (torch.randn(len(slots), hidden, generator=gen) * 3).to(device, dtype)
    weight = torch.randn(hidden, generator=gen).to(device, dtype)
    return dict(x=x, y=y, residual=residual, weight=weight, lora_a=lora_a, lora_b=lora_b, proj=proj, step=step)


def tolerance(dtype):
    # The delta's float32 sum runs in another order than the reference's: its cast may tip by one unit.
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.07, rtol=0.02)


@pytest.mark.parametrize("case", NORM_CASES, ids=["three-adapters", "hidden-64", "rank-40"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_norm_with_delta_matches_reference(ops, device, case, dtype):
    fused, _ = ops
    p = build_norm(case, device, dtype)
    delta = random_delta(fused, p["step"], p["proj"], p["lora_b"], [0], device)
    normed, summed = fused.add_rms_norm(p["y"], p["residual"], p["weight"], 1e-5, delta=delta)
    expected_normed, expected_summed = fused.add_rms_norm_torch(p["y"], p["residual"], p["weight"], 1e-5,
                                                                delta=delta)
    plain_normed, plain_summed = fused.add_rms_norm(p["y"], p["residual"], p["weight"], 1e-5)
    for i, slot in enumerate(case[2]):
        if slot < 0 or case[1][slot] == 0:  # no adapter or rank 0 on o: exactly the plain norm's row
            assert torch.equal(summed[i], plain_summed[i]) and torch.equal(normed[i], plain_normed[i])
        else:
            assert not torch.equal(summed[i], plain_summed[i])
    torch.testing.assert_close(summed, expected_summed, **tolerance(dtype))
    torch.testing.assert_close(normed, expected_normed, **tolerance(dtype))
    assert torch.isfinite(summed).all(), "read t past a token's rank"


@pytest.mark.parametrize("case", NORM_CASES, ids=["three-adapters", "hidden-64", "rank-40"])
def test_shrink_then_norm_is_add_lora_then_norm(ops, device, case):
    fused, lora_delta = ops
    p = build_norm(case, device, torch.float32)
    assert lora_delta.is_decode_delta(p["proj"], p["step"])
    delta = lora_delta.shrink_delta(p["x"], p["lora_a"], p["lora_b"], p["proj"], p["step"])
    normed, summed = fused.add_rms_norm(p["y"], p["residual"], p["weight"], 1e-5, delta=delta)
    y = p["y"].clone()
    add_lora_torch(y, p["x"], p["lora_a"], p["lora_b"], p["proj"], p["step"])
    expected_normed, expected_summed = fused.add_rms_norm_torch(y, p["residual"], p["weight"], 1e-5)
    torch.testing.assert_close(summed, expected_summed, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(normed, expected_normed, atol=1e-4, rtol=1e-4)


def build_rotary(case, device, dtype, seed=0):
    num_heads, num_kv_heads, head_dim, ranks, slots = case
    gen = torch.Generator().manual_seed(seed)
    widths = [num_heads * head_dim] + [num_kv_heads * head_dim] * 2
    step = prepare_lora_step(slots, len(ranks), device)
    lora_a, lora_b = pools(widths, len(ranks), 40, device, dtype, gen)
    proj = prepare_lora_proj([[2 + 64 * a] * 3 for a in range(len(ranks))], ranks,
                             [[0.5 + 0.25 * s + 0.1 * a for s in range(3)] for a in range(len(ranks))], device)
    num_tokens = len(slots)
    qkv = torch.randn(num_tokens, sum(widths), generator=gen).to(device, dtype)
    x = torch.randn(num_tokens, 40, generator=gen).to(device, dtype)
    positions = torch.randint(0, 4000, (num_tokens,), generator=gen).to(device)
    inv_freq = (1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)).to(device)
    num_blocks, block_size = num_tokens, 4
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slot_mapping[1] = -1  # a token whose K/V is not stored
    caches = [torch.full((num_blocks, block_size, num_kv_heads, head_dim), math.nan).to(device, dtype)
              for _ in range(2)]
    return dict(qkv=qkv, x=x, lora_a=lora_a, lora_b=lora_b, proj=proj, step=step, positions=positions,
                inv_freq=inv_freq, key_cache=caches[0], value_cache=caches[1], slot_mapping=slot_mapping.to(device),
                heads=(num_heads, num_kv_heads, head_dim))


def rotate(fused, p, qkv, delta, is_reference):
    """Runs the rotary with the KV-cache write on views of qkv (q rotated in place there); returns (q, caches)."""
    num_heads, num_kv_heads, head_dim = p["heads"]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = (q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim),
               v.view(-1, num_kv_heads, head_dim))
    caches = (p["key_cache"].clone(), p["value_cache"].clone())
    op = fused.rotary_kv_cache_torch_ if is_reference else fused.rotary_kv_cache_
    op(q, k, v, p["positions"], p["inv_freq"], 0.9, *caches, p["slot_mapping"], delta=delta)
    return q, caches


@pytest.mark.parametrize("case", ROTARY_CASES, ids=["gqa", "head-dim-24", "rank-40"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rotary_with_delta_matches_reference(ops, device, case, dtype):
    fused, _ = ops
    p = build_rotary(case, device, dtype)
    delta = random_delta(fused, p["step"], p["proj"], p["lora_b"], [0, 2, 1], device)  # t columns q, v, k
    q, caches = rotate(fused, p, p["qkv"].clone(), delta, is_reference=False)
    expected_q, expected_caches = rotate(fused, p, p["qkv"].clone(), delta, is_reference=True)
    plain_q, _ = rotate(fused, p, p["qkv"].clone(), None, is_reference=False)
    for i, slot in enumerate(case[4]):
        assert torch.equal(q[i], plain_q[i]) == (slot < 0 or case[3][slot][0] == 0)
    # Rotary on CUDA differs from torch's cos/sin in last bits (test_fused.py): a unit of the dtype more.
    tol = tolerance(dtype) if dtype == torch.float32 or not HAS_CUDA else dict(atol=0.1, rtol=0.03)
    torch.testing.assert_close(q, expected_q, **tol)
    for cache, expected in zip(caches, expected_caches):
        torch.testing.assert_close(cache, expected, equal_nan=True, **tol)
    assert torch.isfinite(q).all(), "read t past a token's rank"


@pytest.mark.parametrize("case", ROTARY_CASES, ids=["gqa", "head-dim-24", "rank-40"])
def test_shrink_then_rotary_is_add_lora_then_rotary(ops, device, case):
    fused, lora_delta = ops
    p = build_rotary(case, device, torch.float32)
    assert lora_delta.is_decode_delta(p["proj"], p["step"])
    delta = lora_delta.shrink_delta(p["x"], p["lora_a"], p["lora_b"], p["proj"], p["step"])
    q, caches = rotate(fused, p, p["qkv"].clone(), delta, is_reference=False)
    qkv = p["qkv"].clone()
    add_lora_torch(qkv, p["x"], p["lora_a"], p["lora_b"], p["proj"], p["step"])
    expected_q, expected_caches = rotate(fused, p, qkv, None, is_reference=True)
    torch.testing.assert_close(q, expected_q, atol=1e-4, rtol=1e-4)
    for cache, expected in zip(caches, expected_caches):
        torch.testing.assert_close(cache, expected, atol=1e-4, rtol=1e-4, equal_nan=True)


def test_is_decode_delta_takes_decode_shaped_steps_only(device):
    from kubelora.kernels import lora_delta

    proj = prepare_lora_proj([[0], [16]], [[8], [4]], [[1.0], [1.0]], device)
    rank0 = prepare_lora_proj([[0], [16]], [[0], [0]], [[1.0], [1.0]], device)
    qkv = prepare_lora_proj([[0, 8, 16]], [[8, 0, 8]], [[1.0] * 3], device)
    decode = prepare_lora_step([0, 1, -1, 1], 2, device)
    assert lora_delta.is_decode_delta(proj, decode)
    assert lora_delta.is_decode_delta(qkv, prepare_lora_step([0, 0], 1, device))
    assert not lora_delta.is_decode_delta(rank0, decode)
    assert not lora_delta.is_decode_delta(proj, prepare_lora_step([0] * 9 + [1], 2, device)), "9 tokens of one"
    assert not lora_delta.is_decode_delta(proj, prepare_lora_step([0] * 2048, 2, device)), "a prefill"
    assert not lora_delta.is_decode_delta(proj, prepare_lora_step([-1, -1], 2, device)), "no adapter in the step"
