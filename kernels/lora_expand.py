"""LoRA expand: each LoRA token's shrink row times its adapter's B, scaled and added into its y slices.

The Triton kernel and its PyTorch reference share one signature. One launch covers every slice of the
projection: the grid's column blocks run over the slices' widths laid end to end, so q, k and v of
different widths (GQA) or gate and up share one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kubelora.kernels.lora import LoRAProj, LoRAStep
from kubelora.kernels.lora_config import BLOCK_R, MAX_SLICES, KernelConfig, dot_precision
from kubelora.kernels.lora_tile import gdc_wait, tile_meta, uses_pdl


@triton.jit
def _expand_kernel(
    y_ptr, b0_ptr, b1_ptr, b2_ptr, t_ptr, sorted_ptr, tiles_ptr, rank_ptr, row_ptr, scale_ptr,
    col0, col1, col2, meta_stride, width0, width1, width2, y_off0, y_off1, y_off2, first_nb1, first_nb2,
    y_stride, lanes,
    NUM_S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    SLOT_TILES: tl.constexpr, FOLDED: tl.constexpr, B_FIRST: tl.constexpr, USE_PDL: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # Program (column block of one slice, tile of tokens of one slot). Which slice: by the column block.
    pid_n = tl.program_id(0)
    tile = tl.program_id(1)
    j = 0
    b_ptr = b0_ptr
    col = col0
    width = width0
    y_off = y_off0
    nb = pid_n
    if NUM_S > 1:
        in1 = pid_n >= first_nb1
        j = tl.where(in1, 1, j)
        b_ptr = tl.where(in1, b1_ptr, b_ptr)
        col = tl.where(in1, col1, col)
        width = tl.where(in1, width1, width)
        y_off = tl.where(in1, y_off1, y_off)
        nb = tl.where(in1, pid_n - first_nb1, nb)
    if NUM_S > 2:
        in2 = pid_n >= first_nb2
        j = tl.where(in2, 2, j)
        b_ptr = tl.where(in2, b2_ptr, b_ptr)
        col = tl.where(in2, col2, col)
        width = tl.where(in2, width2, width)
        y_off = tl.where(in2, y_off2, y_off)
        nb = tl.where(in2, pid_n - first_nb2, nb)
    slot, start, count, tok = tile_meta(tiles_ptr, sorted_ptr, tile, BLOCK_M, SLOT_TILES, FOLDED)
    rank = tl.load(rank_ptr + slot * meta_stride + col)
    row = tl.load(row_ptr + slot * meta_stride + col)
    scale = tl.load(scale_ptr + slot * meta_stride + col)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < width
    # y is loaded first so that its bytes are in flight while t and B arrive. Rows past the tile's tokens
    # and slices the adapter does not adapt (rank 0) are neither read nor written.
    y_rows = offs_m < tl.where(rank > 0, count, 0)
    y_mask = y_rows[:, None] & n_mask[None, :]
    y_ptrs = y_ptr + tok[:, None] * y_stride + y_off + offs_n[None, :]
    y_old = tl.load(y_ptrs, mask=y_mask, other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    t_rows = t_ptr + ((start + offs_m) * NUM_S + j)[:, None] * lanes
    r_first = 0
    if B_FIRST:
        # The first B chunk is requested before t. Launched early (programmatic dependent launch, USE_PDL
        # implies B_FIRST): metadata, y and that chunk load while the shrink still runs; t is complete only
        # past the wait.
        lanes0 = tl.arange(0, BLOCK_R)
        b0_mask = (lanes0 < rank)[:, None] & n_mask[None, :]
        b0 = tl.load(b_ptr + (row + lanes0)[:, None] * width + offs_n[None, :], mask=b0_mask, other=0.0)
        if USE_PDL:
            gdc_wait()
        t0 = tl.load(t_rows + lanes0[None, :], mask=m_mask[:, None] & (lanes0 < rank)[None, :], other=0.0)
        acc = tl.dot((t0 * scale).to(b0.dtype), b0, acc, input_precision=PRECISION)
        r_first = BLOCK_R
    # The rank loop runs to this adapter's own rank (rounded up to BLOCK_R), not the step's maximum.
    for r0 in range(r_first, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        t = tl.load(t_rows + offs_r[None, :], mask=m_mask[:, None] & r_mask[None, :], other=0.0)
        b_mask = r_mask[:, None] & n_mask[None, :]
        b = tl.load(b_ptr + (row + offs_r)[:, None] * width + offs_n[None, :], mask=b_mask, other=0.0)
        acc = tl.dot((t * scale).to(b.dtype), b, acc, input_precision=PRECISION)
    tl.store(y_ptrs, (y_old.to(tl.float32) + acc).to(y_old.dtype), mask=y_mask)


def lora_expand(
    y: torch.Tensor,
    t: torch.Tensor,
    lora_b: list[torch.Tensor],
    proj: LoRAProj,
    step: LoRAStep,
    slices: list[int],
    y_offsets: list[int],
    config: KernelConfig,
) -> None:
    """Triton: y[tok, off_j:off_j+d_j] += scale[a,s] * t[i, j, :r] @ B_{a,s}^T, tok = sorted[i], s = slices[j].

    y: [num_tokens, total_width]; t: [num_lora_tokens, len(slices), lanes] from the shrink;
    lora_b[j]: [num_rows, d_j], the pool of slice slices[j]; y_offsets[j]: its first column in y.
    Rows of tokens without adapter and slices of rank 0 are not touched.
    """
    assert 1 <= len(slices) <= MAX_SLICES and len(lora_b) == len(slices) == len(y_offsets)
    assert y.stride(1) == 1 and t.is_contiguous() and all(b.is_contiguous() for b in lora_b)
    widths = [b.shape[1] for b in lora_b]
    num_blocks = [triton.cdiv(w, config.block_n) for w in widths]
    first_nb = [sum(num_blocks[:j]) for j in range(MAX_SLICES)]
    pad = MAX_SLICES - len(slices)
    use_pdl = uses_pdl(config.is_pdl, y.device)
    _expand_kernel[(sum(num_blocks), step.num_tiles)](
        y, *(lora_b + [lora_b[0]] * pad), t, step.sorted_tokens, step.tiles, proj.rank, proj.row_start, proj.scale,
        *(slices + [slices[0]] * pad), proj.rank.stride(0), *(widths + [widths[0]] * pad),
        *(y_offsets + [y_offsets[0]] * pad), first_nb[1], first_nb[2],
        y.stride(0), t.shape[2],
        NUM_S=len(slices), BLOCK_M=step.block_m, BLOCK_N=config.block_n, BLOCK_R=BLOCK_R,
        SLOT_TILES=step.is_slot_tiles, FOLDED=config.is_folded, B_FIRST=config.is_pdl, USE_PDL=use_pdl,
        PRECISION=dot_precision(lora_b[0].dtype), num_warps=config.expand_warps, num_stages=config.expand_stages,
        **({"launch_pdl": True} if use_pdl else {}),
    )


def lora_expand_torch(
    y: torch.Tensor,
    t: torch.Tensor,
    lora_b: list[torch.Tensor],
    proj: LoRAProj,
    step: LoRAStep,
    slices: list[int],
    y_offsets: list[int],
    config: KernelConfig | None = None,
) -> None:
    """Reference: y[tok, off_j:off_j+d_j] += scale[a,s] * t[i, j, :r] @ B_{a,s}^T, tok = sorted[i], s = slices[j].

    Same arguments as `lora_expand` (config ignored); computes in float32, adds once into y.
    """
    tokens = step.sorted_tokens
    token_slot = step.token_slots[tokens]
    for j, (s, b_pool, off) in enumerate(zip(slices, lora_b, y_offsets)):
        for slot in range(step.num_slots):
            rank, row = int(proj.rank[slot, s]), int(proj.row_start[slot, s])
            pos = torch.nonzero(token_slot == slot).flatten()
            if rank == 0 or pos.numel() == 0:
                continue
            delta = float(proj.scale[slot, s]) * (t[pos, j, :rank] @ b_pool[row : row + rank].float())
            cols = slice(off, off + b_pool.shape[1])
            y[tokens[pos], cols] = (y[tokens[pos], cols].float() + delta).to(y.dtype)
