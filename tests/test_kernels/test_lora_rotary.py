"""The q/k/v LoRA expand fused with the rotary embedding and the KV-cache write (kernels/lora_rotary.py) against its
reference, and the whole prefill op (shrink, fused launch, the rotary kernel's masked launch for tokens without an
adapter) against `add_lora` followed by `fused.rotary_kv_cache_torch_`. Under the CPU interpreter in float32."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from kubelora.kernels.lora import prepare_lora_proj, prepare_lora_step
from kubelora.kernels.lora_config import BLOCK_R

DTYPE = torch.bfloat16 if torch.cuda.is_available() else torch.float32
# (heads, kv heads, head_dim, ranks per adapter (q, k, v), tokens per prompt, the prompts' adapters (-1: none),
#  tile heights to choose from)
CASES = [
    (6, 2, 32, [[8, 8, 8], [16, 0, 24]], [40, 23, 9], [0, 1, 0], (32,)),  # 6 q heads: a group of 4 and 2
    (2, 1, 32, [[3, 5, 7]], [70, 6, 30], [0, -1, 0], (64,)),
    (4, 4, 64, [[16, 16, 16], [40, 4, 1], [2, 2, 2]], [17, 33, 5, 20], [2, 0, -1, 1], (32, 64)),
    (4, 2, 16, [[8, 8, 8], [20, 0, 3]], [30, 12, 25], [1, -1, 0], (32,)),  # halves of 8: CUDA-core products
]


def rotary_module():
    return sys.modules["kubelora.kernels.lora_rotary"]


def build(case, device, seed=0):
    num_heads, num_kv_heads, head_dim, ranks, lengths, prompt_slots, heights = case
    gen = torch.Generator().manual_seed(seed)
    widths = [num_heads * head_dim] + [num_kv_heads * head_dim] * 2
    num_tokens = sum(lengths)
    slots = [s for n, s in zip(lengths, prompt_slots) for _ in range(n)]
    step = prepare_lora_step(slots, len(ranks), device, tile_heights=heights)
    row_start = [[1 + 3 * a * 64 + 64 * s for s in range(3)] for a in range(len(ranks))]  # apart, in one pool
    pool_rows = 3 * len(ranks) * 64 + 70
    lora_a = [torch.randn(pool_rows, 48, generator=gen).to(device, DTYPE) / 7 for _ in widths]
    lora_b = [torch.randn(pool_rows, w, generator=gen).to(device, DTYPE) for w in widths]
    scale = [[0.5 + 0.25 * s for s in range(3)] for _ in ranks]
    proj = prepare_lora_proj(row_start, ranks, scale, device)
    qkv = torch.randn(num_tokens, sum(widths), generator=gen).to(device, DTYPE)
    x = torch.randn(num_tokens, 48, generator=gen).to(device, DTYPE)
    positions = torch.randint(0, 4000, (num_tokens,), generator=gen).to(device)
    inv_freq = (1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)).to(device)
    block_size, num_blocks = 16, math.ceil(num_tokens / 16) + 2
    flat = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    flat[3] = -1  # a token whose K/V is not stored
    caches = [torch.full((num_blocks, block_size, num_kv_heads, head_dim), math.nan).to(device, DTYPE)
              for _ in range(2)]
    return dict(qkv=qkv, x=x, lora_a=lora_a, lora_b=lora_b, proj=proj, step=step, num_heads=num_heads,
                num_kv_heads=num_kv_heads, positions=positions, inv_freq=inv_freq, attention_scaling=0.9,
                key_cache=caches[0], value_cache=caches[1], slot_mapping=flat.to(device))


def cloned(p):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in p.items()}


def assert_close_rows(got, want, name):
    """Equal NaN (never written) places; elsewhere each row within the dtype's rounding of its norm (bf16 on a GPU:
    the delta's last bit moves the rotated values by one ulp of the larger ones)."""
    got, want = got.reshape(-1, got.shape[-1]).double(), want.reshape(-1, want.shape[-1]).double()
    assert torch.equal(got.isnan(), want.isnan()), name
    got, want = got.nan_to_num(), want.nan_to_num()
    limit = (2e-2 if DTYPE == torch.bfloat16 else 1e-6) * want.norm(dim=1) + 1e-6
    assert ((got - want).norm(dim=1) <= limit).all(), (name, float(((got - want).norm(dim=1) / limit).max()))


def assert_same_outputs(got, want):
    for name in ("qkv", "key_cache", "value_cache"):
        assert_close_rows(got[name], want[name], name)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"h{c[0]}-kv{c[1]}-d{c[2]}-{len(c[3])}ad")
def test_fused_launch_matches_reference(triton_backend, device, case):
    mod = rotary_module()
    p = build(case, device)
    assert p["step"].block_m > 16 and mod.is_expand_rotary(p["proj"], p["step"], case[2])
    lanes = -(-max(max(r) for r in case[3]) // BLOCK_R) * BLOCK_R
    t = torch.randn(p["step"].num_lora_tokens, 3, lanes, generator=torch.Generator().manual_seed(1)).to(device)
    rank = p["proj"].rank[p["step"].token_slots[p["step"].sorted_tokens]]  # [lora tokens, 3]
    t[torch.arange(lanes, device=device) >= rank[..., None]] = math.nan  # lanes past a rank: never read
    args = ("qkv", "lora_b", "proj", "step", "num_heads", "num_kv_heads", "positions", "inv_freq", "attention_scaling",
            "key_cache", "value_cache", "slot_mapping")
    got, want = cloned(p), cloned(p)
    mod.launch_expand_rotary(got["qkv"], t, *[got[a] for a in args[1:]])
    mod.expand_rotary_kv_torch_(want["qkv"], t, *[want[a] for a in args[1:]])
    assert_same_outputs(got, want)
    adapted = torch.zeros(p["qkv"].shape[0], dtype=torch.bool, device=device)
    adapted[p["step"].sorted_tokens] = True
    assert torch.equal(got["qkv"][~adapted], p["qkv"][~adapted])  # tokens without an adapter: left to rotary
    q_dim = case[0] * case[2]
    assert torch.equal(got["qkv"][:, q_dim:], p["qkv"][:, q_dim:])  # k and v stay the base's
    stored = p["slot_mapping"][adapted & (p["slot_mapping"] >= 0)]
    assert not got["key_cache"].view(-1, case[1], case[2])[stored].isnan().any()


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"h{c[0]}-kv{c[1]}-d{c[2]}-{len(c[3])}ad")
def test_prefill_op_matches_add_lora_then_rotary(triton_backend, device, case):
    from kubelora.kernels import fused
    from kubelora.kernels.lora import add_lora

    mod = rotary_module()
    p = build(case, device, seed=2)
    got, want = cloned(p), cloned(p)
    mod.add_lora_rotary_kv_cache_(got["qkv"], got["x"], got["lora_a"], got["lora_b"], got["proj"], got["step"],
                                  case[0], case[1], got["positions"], got["inv_freq"], 0.9, got["key_cache"],
                                  got["value_cache"], got["slot_mapping"])
    add_lora(want["qkv"], want["x"], want["lora_a"], want["lora_b"], want["proj"], want["step"], backend="torch")
    head_dim = case[2]
    q, k, v = want["qkv"].split([case[0] * head_dim, case[1] * head_dim, case[1] * head_dim], dim=-1)
    q = q.reshape(-1, case[0], head_dim)
    fused.rotary_kv_cache_torch_(q, k.reshape(-1, case[1], head_dim), v.reshape(-1, case[1], head_dim),
                                 want["positions"], want["inv_freq"], 0.9, want["key_cache"], want["value_cache"],
                                 want["slot_mapping"])
    q_dim = case[0] * head_dim
    assert_close_rows(got["qkv"][:, :q_dim], q.reshape(-1, q_dim), "q")
    for name in ("key_cache", "value_cache"):
        assert_close_rows(got[name], want[name], name)


def test_is_expand_rotary_needs_tall_tiles_and_every_slice(device):
    from kubelora.kernels.lora_rotary import is_expand_rotary

    proj = prepare_lora_proj([[0, 0, 0]], [[8, 8, 8]], [[1.0] * 3], device)
    tall = prepare_lora_step([0] * 40, 1, device, tile_heights=(32,))
    decode = prepare_lora_step([0] * 4, 1, device)
    assert is_expand_rotary(proj, tall, 128) and not is_expand_rotary(proj, decode, 128)
    assert not is_expand_rotary(proj, tall, 8) and not is_expand_rotary(proj, tall, 96)
    no_k = prepare_lora_proj([[0, 0, 0]], [[8, 0, 8]], [[1.0] * 3], device)
    assert not is_expand_rotary(no_k, tall, 128)
