"""Fused LoRA for small steps: one launch in which each program recomputes its tile's shrink for one slice.

Program (column range of one slice, tile): t = x[tile] @ A^T at the adapter's own rank, then
y[tile, columns] += scale * t @ B^T over SUB column blocks. No shrink buffer, no K split, no second launch:
the programs of one (tile, slice) each re-read A (from L2 after the first), which costs less than a
launch and a split-K reduction while the step is small (docs/kernels.md, v5). y and the first B block are
loaded before the shrink loop, so their bytes are in flight while t is computed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kubelora.kernels.lora import LoRAProj, LoRAStep
from kubelora.kernels.lora_config import MAX_SLICES, FusedConfig, dot_precision, num_lanes
from kubelora.kernels.lora_expand import lora_expand_torch
from kubelora.kernels.lora_shrink import lora_shrink_torch
from kubelora.kernels.lora_tile import select_slice, tile_meta

SMEM_BUDGET = 160 * 1024  # bytes of pipelined tiles per program (H200: 227 KB of shared memory per block)


@triton.jit
def _fused_kernel(
    y_ptr, x_ptr, a0_ptr, a1_ptr, a2_ptr, b0_ptr, b1_ptr, b2_ptr, sorted_ptr, tiles_ptr, rank_ptr, row_ptr,
    scale_ptr, col0, col1, col2, meta_stride, width0, width1, width2, y_off0, y_off1, y_off2, first_pb1,
    first_pb2, in_dim, x_stride, y_stride,
    NUM_S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    R_PAD: tl.constexpr, SUB: tl.constexpr, SLOT_TILES: tl.constexpr, FOLDED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    tile = tl.program_id(1)
    j, b_ptr, col, width, y_off, pb = select_slice(pid_n, b0_ptr, b1_ptr, b2_ptr, col0, col1, col2, width0, width1,
                                                   width2, y_off0, y_off1, y_off2, first_pb1, first_pb2, NUM_S)
    a_ptr = a0_ptr
    if NUM_S > 1:
        a_ptr = tl.where(j == 1, a1_ptr, a_ptr)
    if NUM_S > 2:
        a_ptr = tl.where(j == 2, a2_ptr, a_ptr)
    slot, start, count, tok = tile_meta(tiles_ptr, sorted_ptr, tile, BLOCK_M, SLOT_TILES, FOLDED)
    rank = tl.load(rank_ptr + slot * meta_stride + col)
    row = tl.load(row_ptr + slot * meta_stride + col)
    scale = tl.load(scale_ptr + slot * meta_stride + col)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    offs_r = tl.arange(0, R_PAD)
    r_mask = offs_r < rank  # lanes past the adapter's rank: no bytes move, t stays zero there
    # Rows of y past the tile's tokens, and slices the adapter does not adapt, are neither read nor written.
    y_rows = (offs_m < tl.where(rank > 0, count, 0))[:, None]
    offs_n = pb * (SUB * BLOCK_N) + tl.arange(0, BLOCK_N)
    y_ptrs = y_ptr + tok[:, None] * y_stride + y_off + offs_n[None, :]
    b_ptrs = b_ptr + (row + offs_r)[:, None] * width + offs_n[None, :]
    n_mask = (offs_n < width)[None, :]
    y_cur = tl.load(y_ptrs, mask=y_rows & n_mask, other=0.0)
    b_cur = tl.load(b_ptrs, mask=r_mask[:, None] & n_mask, other=0.0)
    acc_t = tl.zeros([BLOCK_M, R_PAD], dtype=tl.float32)
    k_hi = tl.where((count > 0) & (rank > 0), in_dim, 0)
    x_rows = x_ptr + tok[:, None] * x_stride
    a_rows = a_ptr + (row + offs_r)[:, None] * in_dim
    for k in range(0, k_hi, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_mask = (offs_k < in_dim)[None, :]
        x_tile = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask, other=0.0)
        a = tl.load(a_rows + offs_k[None, :], mask=r_mask[:, None] & k_mask, other=0.0)
        acc_t = tl.dot(x_tile, tl.trans(a), acc_t, input_precision=PRECISION)
    t = (acc_t * scale).to(b_cur.dtype)
    for sub in tl.static_range(SUB):
        # The next block's y and B are requested before this block's product is stored.
        y_nxt = y_cur
        b_nxt = b_cur
        if sub + 1 < SUB:
            n_mask_nxt = (offs_n + (sub + 1) * BLOCK_N < width)[None, :]
            y_nxt = tl.load(y_ptrs + (sub + 1) * BLOCK_N, mask=y_rows & n_mask_nxt, other=0.0)
            b_nxt = tl.load(b_ptrs + (sub + 1) * BLOCK_N, mask=r_mask[:, None] & n_mask_nxt, other=0.0)
        acc = tl.dot(t, b_cur, input_precision=PRECISION)
        n_mask = (offs_n + sub * BLOCK_N < width)[None, :]
        tl.store(y_ptrs + sub * BLOCK_N, (y_cur.to(tl.float32) + acc).to(y_cur.dtype), mask=y_rows & n_mask)
        y_cur = y_nxt
        b_cur = b_nxt


def plan_blocks(num_blocks: int, max_blocks: int, config: FusedConfig) -> int:
    """Column blocks per program (a power of two): enough programs, each re-reading A as few times as that allows."""
    sub = 1
    while num_blocks // (2 * sub) >= config.target_programs and 2 * sub <= max_blocks:
        sub *= 2
    return sub


def lora_fused(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    proj: LoRAProj,
    step: LoRAStep,
    slices: list[int],
    y_offsets: list[int],
    config: FusedConfig,
) -> None:
    """Triton: y[tok, off_j:off_j+d_j] += scale[a,s] * (x[tok] @ A_{a,s}^T) @ B_{a,s}^T, s = slices[j], a = slot of tok.

    x: [num_tokens, in_dim]; y: [num_tokens, total_width]; lora_a[j]: [num_rows, in_dim] and lora_b[j]:
    [num_rows, d_j], the pools of slice slices[j] (at most 3 slices); y_offsets[j]: its first column in y.
    Rows of tokens without adapter and slices of rank 0 are not touched.
    """
    assert 1 <= len(slices) <= MAX_SLICES and len(lora_a) == len(lora_b) == len(slices) == len(y_offsets)
    assert x.stride(1) == 1 and y.stride(1) == 1
    assert all(a.is_contiguous() and b.is_contiguous() and a.dtype == x.dtype for a, b in zip(lora_a, lora_b))
    widths = [b.shape[1] for b in lora_b]
    blocks = [triton.cdiv(w, config.block_n) for w in widths]
    sub = plan_blocks(sum(blocks) * step.num_tiles, max(blocks), config)
    programs = [triton.cdiv(nb, sub) for nb in blocks]
    first_pb = [sum(programs[:j]) for j in range(MAX_SLICES)]
    pad = MAX_SLICES - len(slices)
    r_pad = triton.next_power_of_2(num_lanes(proj, slices))
    # Each pipeline stage holds an x tile and an A tile: narrower in_dim steps keep tall tiles and high
    # ranks within shared memory (run 8: 64 rows x 128 lanes x 256 columns x 3 stages asked 360 KB).
    block_k = config.block_k
    while block_k > 16 and (step.block_m + r_pad) * block_k * x.element_size() * config.stages > SMEM_BUDGET:
        block_k //= 2
    _fused_kernel[(sum(programs), step.num_tiles)](
        y, x, *(lora_a + [lora_a[0]] * pad), *(lora_b + [lora_b[0]] * pad), step.sorted_tokens, step.tiles,
        proj.rank, proj.row_start, proj.scale, *(slices + [slices[0]] * pad), proj.rank.stride(0),
        *(widths + [widths[0]] * pad), *(y_offsets + [y_offsets[0]] * pad), first_pb[1], first_pb[2],
        x.shape[1], x.stride(0), y.stride(0),
        NUM_S=len(slices), BLOCK_M=step.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k,
        R_PAD=r_pad, SUB=sub, SLOT_TILES=step.is_slot_tiles, FOLDED=config.is_folded,
        PRECISION=dot_precision(x.dtype), num_warps=config.warps if r_pad < 64 else config.wide_warps,
        num_stages=config.stages,
    )


def lora_fused_torch(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    proj: LoRAProj,
    step: LoRAStep,
    slices: list[int],
    y_offsets: list[int],
    config: FusedConfig | None = None,
) -> None:
    """Reference: the shrink and expand references in sequence (same arguments as `lora_fused`)."""
    t = lora_shrink_torch(x, lora_a, proj, step, slices)
    lora_expand_torch(y, t, lora_b, proj, step, slices, y_offsets)
