"""LoRA shrink: each LoRA token's input row times its adapter's A, at that adapter's own rank.

The Triton kernel and its PyTorch reference share one signature. Both work on the slot-sorted view of the
step (`LoRAStep.sorted_tokens`, `LoRAStep.tiles`) and write `t` in sorted order, so the expand reads one
tile's rows contiguously. The kernel splits the reduction over in_dim into `split_k` partial sums (the
expand adds them), because a decode step has too few (tile, rank chunk) pairs to fill the GPU on its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kubelora.kernels.lora import LoRAProj, LoRAStep
from kubelora.kernels.lora_config import BLOCK_R, MAX_SLICES, KernelConfig, dot_precision, num_lanes


@triton.jit
def _shrink_dot(acc, x_tile, a_ptr, row_start, rank, offs_r, offs_k, k_mask, in_dim, PRECISION: tl.constexpr):
    # A rows beyond the adapter's rank are masked: no bytes move for them, the lanes stay zero.
    a_mask = (offs_r < rank)[:, None] & k_mask[None, :]
    a = tl.load(a_ptr + (row_start + offs_r)[:, None] * in_dim + offs_k[None, :], mask=a_mask, other=0.0)
    return tl.dot(x_tile, tl.trans(a), acc, input_precision=PRECISION)


@triton.jit
def _shrink_kernel(
    x_ptr, a0_ptr, a1_ptr, a2_ptr, t_ptr, sorted_ptr, tiles_ptr, rank_ptr, row_ptr,
    col0, col1, col2, meta_stride, in_dim, x_stride, num_sorted, num_chunks, lanes, k_per_split,
    NUM_S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # Program (tile, rank chunk of BLOCK_R lanes, K split): all slices at once, so x is read once per split.
    tile = tl.program_id(0) // num_chunks
    chunk = tl.program_id(0) % num_chunks
    ks = tl.program_id(1)
    slot = tl.load(tiles_ptr + tile * 3)
    start = tl.load(tiles_ptr + tile * 3 + 1)
    count = tl.load(tiles_ptr + tile * 3 + 2)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    tok = tl.load(sorted_ptr + start + offs_m, mask=m_mask, other=0)
    offs_r = chunk * BLOCK_R + tl.arange(0, BLOCK_R)
    rank0 = tl.load(rank_ptr + slot * meta_stride + col0)
    row0 = tl.load(row_ptr + slot * meta_stride + col0)
    rank1 = rank0
    row1 = row0
    rank2 = rank0
    row2 = row0
    if NUM_S > 1:
        rank1 = tl.load(rank_ptr + slot * meta_stride + col1)
        row1 = tl.load(row_ptr + slot * meta_stride + col1)
    if NUM_S > 2:
        rank2 = tl.load(rank_ptr + slot * meta_stride + col2)
        row2 = tl.load(row_ptr + slot * meta_stride + col2)
    max_rank = tl.maximum(tl.maximum(rank0, rank1), rank2)
    k_lo = ks * k_per_split
    # A chunk past every slice's rank (a low-rank adapter in a high-rank step) runs no loop at all.
    k_hi = tl.where(chunk * BLOCK_R < max_rank, tl.minimum(k_lo + k_per_split, in_dim), k_lo)
    acc0 = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    x_rows = x_ptr + tok[:, None] * x_stride
    for k in range(k_lo, k_hi, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        x_tile = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc0 = _shrink_dot(acc0, x_tile, a0_ptr, row0, rank0, offs_r, offs_k, k_mask, in_dim, PRECISION)
        if NUM_S > 1:
            acc1 = _shrink_dot(acc1, x_tile, a1_ptr, row1, rank1, offs_r, offs_k, k_mask, in_dim, PRECISION)
        if NUM_S > 2:
            acc2 = _shrink_dot(acc2, x_tile, a2_ptr, row2, rank2, offs_r, offs_k, k_mask, in_dim, PRECISION)
    # t: [split_k, num_sorted, NUM_S, lanes]; only lanes below each slice's rank are written.
    t_rows = t_ptr + ((ks * num_sorted + start + offs_m) * NUM_S)[:, None] * lanes + offs_r[None, :]
    tl.store(t_rows, acc0, mask=m_mask[:, None] & (offs_r < rank0)[None, :])
    if NUM_S > 1:
        tl.store(t_rows + lanes, acc1, mask=m_mask[:, None] & (offs_r < rank1)[None, :])
    if NUM_S > 2:
        tl.store(t_rows + 2 * lanes, acc2, mask=m_mask[:, None] & (offs_r < rank2)[None, :])


def _new_workspace(*shape: int, device: torch.device) -> torch.Tensor:
    # Uninitialised on purpose: the expand reads only what the shrink wrote (tests poison it through here).
    return torch.empty(shape, device=device, dtype=torch.float32)


def plan_split(in_dim: int, num_programs: int, config: KernelConfig, split_k: int | None) -> tuple[int, int]:
    """(split_k, k_per_split): enough K splits to reach config.target_programs, each a multiple of BLOCK_K."""
    if split_k is None:
        split_k = max(1, min(config.max_split, config.target_programs // max(num_programs, 1)))
    k_per_split = triton.cdiv(triton.cdiv(in_dim, split_k), config.block_k) * config.block_k
    return triton.cdiv(in_dim, k_per_split), k_per_split


def lora_shrink(
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    proj: LoRAProj,
    step: LoRAStep,
    slices: list[int],
    config: KernelConfig,
    split_k: int | None = None,
) -> torch.Tensor:
    """Triton: sum_k t[k, i, j, :r] = x[sorted[i]] @ A_{a,s}^T, a = slot of sorted[i], s = slices[j], r = rank[a, s].

    x: [num_tokens, in_dim]; lora_a[j]: [num_rows, in_dim], the pool of slice slices[j] (at most 3 slices);
    returns t: [split_k, num_lora_tokens, len(slices), lanes] float32, lanes = max rank rounded up to
    BLOCK_R. Lanes at or past a token's rank are not written (garbage); the expand never reads them.
    """
    assert 1 <= len(slices) <= MAX_SLICES and len(lora_a) == len(slices)
    assert x.stride(1) == 1 and all(a.is_contiguous() and a.dtype == x.dtype for a in lora_a)
    lanes = num_lanes(proj, slices)
    num_chunks = lanes // BLOCK_R
    in_dim = x.shape[1]
    split_k, k_per_split = plan_split(in_dim, step.num_tiles * num_chunks, config, split_k)
    t = _new_workspace(split_k, step.sorted_tokens.numel(), len(slices), lanes, device=x.device)
    pools = lora_a + [lora_a[0]] * (MAX_SLICES - len(lora_a))
    cols = slices + [slices[0]] * (MAX_SLICES - len(slices))
    _shrink_kernel[(step.num_tiles * num_chunks, split_k)](
        x, *pools, t, step.sorted_tokens, step.tiles, proj.rank, proj.row_start,
        *cols, proj.rank.stride(0), in_dim, x.stride(0), t.shape[1], num_chunks, lanes, k_per_split,
        NUM_S=len(slices), BLOCK_M=step.block_m, BLOCK_K=config.block_k, BLOCK_R=BLOCK_R,
        PRECISION=dot_precision(x.dtype), num_warps=config.shrink_warps, num_stages=config.num_stages,
    )
    return t


def lora_shrink_torch(
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    proj: LoRAProj,
    step: LoRAStep,
    slices: list[int],
    config: KernelConfig | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """Reference: t[0, i, j, :r] = x[sorted[i]] @ A_{a,s}^T, a = slot of sorted[i], s = slices[j], r = rank[a, s].

    Same arguments as `lora_shrink` (config and split_k ignored); computes in float32, lanes past the
    rank are zero, split_k is 1.
    """
    lanes = num_lanes(proj, slices)
    tokens = step.sorted_tokens
    t = torch.zeros(1, tokens.numel(), len(slices), lanes, device=x.device, dtype=torch.float32)
    token_slot = step.token_slots[tokens]
    for j, (s, a_pool) in enumerate(zip(slices, lora_a)):
        for slot in range(step.num_slots):
            rank, row = int(proj.rank[slot, s]), int(proj.row_start[slot, s])
            pos = torch.nonzero(token_slot == slot).flatten()
            t[0, pos, j, :rank] = x[tokens[pos]].float() @ a_pool[row : row + rank].float().T
    return t
