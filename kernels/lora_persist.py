"""Persistent LoRA: shrink and expand of a decode step in one launch of as many programs as fit on the GPU.

Each program first runs its share of the shrink's (tile, rank chunk, K split) items: it stores the partial
sums and counts them in a counter per (tile, chunk), the signal path's protocol (`signal_partials`). Then it
runs a contiguous range of the expand's (tile, column block) items: per tile it reads the metadata once,
requests the first block's y and B, waits once for the tile's counters, sums t from the partials once per
slice, and walks its blocks with the next block's y and B requested before the current one is stored.

Waiting inside one launch is safe only if every program is resident at once: the grid is sized from the
compiled kernel's registers and shared memory (`resident_programs`), so a program that waits only waits on
programs that are running. The last program to finish zeroes the counters for the next launch. Under the
CPU interpreter programs run one after another, so the two phases run as two launches there.
Against the split and signal paths (docs/kernels.md, v7): one launch instead of two; the expand's y and B
bytes load while other programs still run the shrink; no program waits more than once per tile.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from kubelora.kernels.lora import LoRAProj, LoRAStep
from kubelora.kernels.lora_config import BLOCK_R, MAX_SLICES, PersistConfig, dot_precision, num_lanes
from kubelora.kernels import lora_shrink
from kubelora.kernels.lora_shrink import arrival_counters, plan_split, shrink_tile, signal_partials
from kubelora.kernels.lora_tile import select_slice, sum_splits, tile_meta, wait_arrivals

# Elements of the B block a program holds per column block (rank lanes x columns, twice: current and next).
B_BLOCK_ELEMENTS = 8192
RESET_BLOCK = tl.constexpr(1024)  # counters zeroed per store by the last program


@triton.jit
def _slice_meta(rank_ptr, row_ptr, scale_ptr, slot, meta_stride, col):
    off = slot * meta_stride + col
    return tl.load(rank_ptr + off), tl.load(row_ptr + off), tl.load(scale_ptr + off)


@triton.jit
def _scaled_t(parts_ptr, start, count, j, rank, scale, lanes, plane, split_k, b_ptr,
              NUM_S: tl.constexpr, BLOCK_M: tl.constexpr, R_PAD: tl.constexpr, SPLIT: tl.constexpr):
    # scale * t[tile rows, slice j, :R_PAD] ([BLOCK_M, R_PAD]) in B's dtype, summed over the K-split planes in
    # split order; rows past the tile's count and lanes past the slice's rank are zero.
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, R_PAD)
    rows = ((start + offs_m) * NUM_S + j)[:, None] * lanes + offs_r[None, :]
    mask = (offs_m < count)[:, None] & (offs_r < rank)[None, :]
    return (sum_splits(parts_ptr, rows, plane, split_k, mask, SPLIT) * scale).to(b_ptr.dtype.element_ty)


@triton.jit
def _pick(j, v0, v1, v2, NUM_S: tl.constexpr):
    # Slice j's value of a per-slice triple (scalars or tensors).
    v = v0
    if NUM_S > 1:
        v = tl.where(j == 1, v1, v)
    if NUM_S > 2:
        v = tl.where(j == 2, v2, v)
    return v


@triton.jit
def _block(pb, pb_hi, y_ptr, b0_ptr, b1_ptr, b2_ptr, width0, width1, width2, y_off0, y_off1, y_off2, first_nb1,
           first_nb2, rank0, rank1, rank2, row0, row1, row2, tok, count, y_stride,
           NUM_S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, R_PAD: tl.constexpr):
    """Column block pb of the tile (blocks over the slices' widths laid end to end): (slice, y ptrs and mask,
    B ptrs and mask), [BLOCK_M, BLOCK_N] and [R_PAD, BLOCK_N].

    Nothing is addressed for pb >= pb_hi (a prefetch past the program's range), for rows past the tile's
    count or of a slice of rank 0, and for B rows past the slice's rank.
    """
    j, b_ptr, _, width, y_off, nb = select_slice(pb, b0_ptr, b1_ptr, b2_ptr, 0, 1, 2, width0, width1, width2,
                                                 y_off0, y_off1, y_off2, first_nb1, first_nb2, NUM_S)
    rank = _pick(j, rank0, rank1, rank2, NUM_S)
    row = _pick(j, row0, row1, row2, NUM_S)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < tl.where(pb < pb_hi, width, 0)
    y_mask = (tl.arange(0, BLOCK_M) < tl.where(rank > 0, count, 0))[:, None] & n_mask[None, :]
    y_ptrs = y_ptr + tok[:, None] * y_stride + y_off + offs_n[None, :]
    offs_r = tl.arange(0, R_PAD)
    b_ptrs = b_ptr + (row + offs_r)[:, None] * width + offs_n[None, :]
    return j, y_ptrs, y_mask, b_ptrs, (offs_r < rank)[:, None] & n_mask[None, :]


@triton.jit
def _persist_kernel(
    y_ptr, x_ptr, a0_ptr, a1_ptr, a2_ptr, b0_ptr, b1_ptr, b2_ptr, parts_ptr, counters_ptr, sorted_ptr, tiles_ptr,
    rank_ptr, row_ptr, scale_ptr, col0, col1, col2, meta_stride, width0, width1, width2, y_off0, y_off1, y_off2,
    first_nb1, first_nb2, in_dim, x_stride, y_stride, num_sorted, num_chunks, lanes, split_k, k_per_split,
    num_tiles, num_blocks,
    NUM_S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, R_PAD: tl.constexpr, SPLIT: tl.constexpr, SLOT_TILES: tl.constexpr,
    PHASES: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    plane = num_sorted * NUM_S * lanes
    if PHASES % 2 == 1:
        # Shrink items (tile x chunk, K split), split fastest: the splits of one (tile, chunk) run on
        # neighbouring programs, at the same time.
        for item in range(pid, num_tiles * num_chunks * split_k, num_programs):
            tc = item // split_k
            ks = item % split_k
            chunk = tc % num_chunks
            acc0, acc1, acc2, start, count, rank0, rank1, rank2 = shrink_tile(
                x_ptr, a0_ptr, a1_ptr, a2_ptr, sorted_ptr, tiles_ptr, rank_ptr, row_ptr, col0, col1, col2,
                meta_stride, in_dim, x_stride, tc // num_chunks, chunk, ks, k_per_split, NUM_S, BLOCK_M, BLOCK_K,
                BLOCK_R, SLOT_TILES, True, PRECISION)
            signal_partials(parts_ptr, counters_ptr + tc, ks, plane, lanes, start, count, chunk, acc0, acc1, acc2,
                            rank0, rank1, rank2, NUM_S, BLOCK_M, BLOCK_R)
    if PHASES >= 2:
        # Expand items (tile, column block), tile-major; this program's are the contiguous range [lo, hi).
        num_items = num_tiles * num_blocks
        lo = pid * num_items // num_programs
        hi = (pid + 1) * num_items // num_programs
        tile_hi = tl.where(hi > lo, tl.cdiv(hi, num_blocks), 0)
        for tile in range(lo // num_blocks, tile_hi):
            pb = tl.maximum(lo - tile * num_blocks, 0)
            pb_hi = tl.minimum(hi - tile * num_blocks, num_blocks)
            slot, start, count, tok = tile_meta(tiles_ptr, sorted_ptr, tile, BLOCK_M, SLOT_TILES, True)
            rank0, row0, scale0 = _slice_meta(rank_ptr, row_ptr, scale_ptr, slot, meta_stride, col0)
            rank1 = rank0
            row1 = row0
            scale1 = scale0
            rank2 = rank0
            row2 = row0
            scale2 = scale0
            if NUM_S > 1:
                rank1, row1, scale1 = _slice_meta(rank_ptr, row_ptr, scale_ptr, slot, meta_stride, col1)
            if NUM_S > 2:
                rank2, row2, scale2 = _slice_meta(rank_ptr, row_ptr, scale_ptr, slot, meta_stride, col2)
            # The first block's y and B are requested before the wait: they load while the shrink finishes.
            j, y_ptrs, y_mask, b_ptrs, b_mask = _block(
                pb, pb_hi, y_ptr, b0_ptr, b1_ptr, b2_ptr, width0, width1, width2, y_off0, y_off1, y_off2, first_nb1,
                first_nb2, rank0, rank1, rank2, row0, row1, row2, tok, count, y_stride, NUM_S, BLOCK_M, BLOCK_N,
                R_PAD)
            b_cur = tl.load(b_ptrs, mask=b_mask, other=0.0)
            y_cur = tl.load(y_ptrs, mask=y_mask, other=0.0)
            max_rank = tl.maximum(tl.maximum(rank0, rank1), rank2)
            wait_arrivals(counters_ptr + tile * num_chunks, tl.where(count > 0, tl.cdiv(max_rank, BLOCK_R), 0),
                          split_k)
            t0 = _scaled_t(parts_ptr, start, count, 0, rank0, scale0, lanes, plane, split_k, b0_ptr, NUM_S, BLOCK_M,
                           R_PAD, SPLIT)
            t1 = t0
            t2 = t0
            if NUM_S > 1:
                t1 = _scaled_t(parts_ptr, start, count, 1, rank1, scale1, lanes, plane, split_k, b0_ptr, NUM_S,
                               BLOCK_M, R_PAD, SPLIT)
            if NUM_S > 2:
                t2 = _scaled_t(parts_ptr, start, count, 2, rank2, scale2, lanes, plane, split_k, b0_ptr, NUM_S,
                               BLOCK_M, R_PAD, SPLIT)
            # Only y and B of the next block are carried over; addresses are recomputed (registers, not loads).
            for blk in range(pb, pb_hi):
                j_nxt, ptrs_nxt, mask_nxt, b_ptrs, b_mask = _block(
                    blk + 1, pb_hi, y_ptr, b0_ptr, b1_ptr, b2_ptr, width0, width1, width2, y_off0, y_off1, y_off2,
                    first_nb1, first_nb2, rank0, rank1, rank2, row0, row1, row2, tok, count, y_stride, NUM_S,
                    BLOCK_M, BLOCK_N, R_PAD)
                b_nxt = tl.load(b_ptrs, mask=b_mask, other=0.0)
                y_nxt = tl.load(ptrs_nxt, mask=mask_nxt, other=0.0)
                j, y_ptrs, y_mask, b_ptrs, b_mask = _block(
                    blk, pb_hi, y_ptr, b0_ptr, b1_ptr, b2_ptr, width0, width1, width2, y_off0, y_off1, y_off2,
                    first_nb1, first_nb2, rank0, rank1, rank2, row0, row1, row2, tok, count, y_stride, NUM_S,
                    BLOCK_M, BLOCK_N, R_PAD)
                acc = tl.dot(_pick(j, t0, t1, t2, NUM_S), b_cur, input_precision=PRECISION)
                tl.store(y_ptrs, (y_cur.to(tl.float32) + acc).to(y_cur.dtype), mask=y_mask)
                y_cur = y_nxt
                b_cur = b_nxt
        # Done waiting: the last program to get here zeroes every counter (and this one) for the next launch.
        done_ptr = counters_ptr + num_tiles * num_chunks
        done = tl.atomic_add(done_ptr, 1, sem="acq_rel")
        if done == num_programs - 1:
            for c in range(0, num_tiles * num_chunks + 1, RESET_BLOCK):
                offs = c + tl.arange(0, RESET_BLOCK)
                tl.store(counters_ptr + offs, tl.zeros([RESET_BLOCK], dtype=tl.int32),
                         mask=offs <= num_tiles * num_chunks)


def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; 4 programs' worth under the CPU interpreter."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _sm_limits(device: torch.device) -> tuple[int, int, int]:
    """(registers, threads, shared memory bytes) of one multiprocessor."""
    props = torch.cuda.get_device_properties(device)
    return (getattr(props, "regs_per_multiprocessor", 65536), props.max_threads_per_multi_processor,
            getattr(props, "shared_memory_per_multiprocessor", 228 * 1024))


def resident_programs(n_regs: int, shared: int, num_warps: int, limits: tuple[int, int, int]) -> int:
    """Programs of one compiled kernel that fit on one multiprocessor at once (at least 1).

    Registers are allocated per warp in units of 256; each block also reserves 1 KB of shared memory.
    """
    regs, threads, smem = limits
    regs_per_warp = -(-max(n_regs, 1) * 32 // 256) * 256
    by_regs = regs // (regs_per_warp * num_warps)
    by_threads = threads // (32 * num_warps)
    by_smem = smem // (shared + 1024)
    return max(1, min(by_regs, by_threads, by_smem))


@dataclass(frozen=True)
class PersistShape:
    """Host-side parameters of one persistent launch, from sizes only: computed once per step, reused per layer."""

    num_programs: int  # wanted: multiprocessors x config.programs_per_sm (fewer if fewer fit, see launch)
    scalars: tuple[int, ...]  # cols, meta_stride, widths, y offsets, first column block of slices 1 and 2
    in_dim: int
    lanes: int  # the partial sums' row width: the max rank rounded up to BLOCK_R
    num_chunks: int
    split_k: int
    k_per_split: int
    num_blocks: int  # column blocks of a tile, over all slices
    num_items: int  # the larger of the shrink's and the expand's item counts: no more programs than that
    constexprs: dict = field(hash=False)


def plan_persist(in_dim: int, widths: list[int], proj: LoRAProj, step: LoRAStep, slices: list[int],
                 y_offsets: list[int], config: PersistConfig, device: torch.device, dtype: torch.dtype) -> PersistShape:
    """The persistent launch's host-side parameters: K splits so the shrink items fill the programs once."""
    assert 1 <= len(slices) <= MAX_SLICES and len(widths) == len(slices) == len(y_offsets)
    lanes = num_lanes(proj, slices)
    num_chunks = lanes // BLOCK_R
    r_pad = triton.next_power_of_2(lanes)
    block_n = max(16, min(config.block_n, B_BLOCK_ELEMENTS // r_pad))
    num_programs = num_sms(device) * config.programs_per_sm
    split_k, k_per_split = plan_split(in_dim, step.num_tiles * num_chunks, config.split_config(num_programs), None)
    num_blocks = [triton.cdiv(w, block_n) for w in widths]
    first_nb = [sum(num_blocks[:j]) for j in range(MAX_SLICES)]
    pad = MAX_SLICES - len(slices)
    scalars = (*(slices + [slices[0]] * pad), proj.rank.stride(0), *(widths + [widths[0]] * pad),
               *(y_offsets + [y_offsets[0]] * pad), first_nb[1], first_nb[2])
    num_items = max(step.num_tiles * num_chunks * split_k, step.num_tiles * sum(num_blocks))
    constexprs = dict(
        NUM_S=len(slices), BLOCK_M=step.block_m, BLOCK_K=config.block_k, BLOCK_N=block_n, BLOCK_R=BLOCK_R,
        R_PAD=r_pad, SPLIT=triton.next_power_of_2(split_k), SLOT_TILES=step.is_slot_tiles,
        PRECISION=dot_precision(dtype), num_warps=config.warps, num_stages=config.stages,
    )
    return PersistShape(num_programs, scalars, in_dim, lanes, num_chunks, split_k, k_per_split, sum(num_blocks),
                        num_items, constexprs)


_resident: dict[tuple, int] = {}


def _grid_size(args: tuple, shape: PersistShape, device: torch.device) -> int:
    """Programs to launch: the wanted number, capped by what fits on the GPU at once and by the items."""
    if device.type != "cuda":
        return min(shape.num_programs, shape.num_items)
    key = (device, tuple(sorted(shape.constexprs.items())))
    per_sm = _resident.get(key)
    if per_sm is None:
        kernel = _persist_kernel.warmup(*args, grid=(1,), PHASES=3, **shape.constexprs)
        kernel._init_handles()
        per_sm = _resident[key] = resident_programs(kernel.n_regs, kernel.metadata.shared,
                                                    shape.constexprs["num_warps"], _sm_limits(device))
    wanted_per_sm = shape.num_programs // num_sms(device)
    return min(num_sms(device) * min(per_sm, wanted_per_sm), shape.num_items)


def launch_persist(y: torch.Tensor, x: torch.Tensor, lora_a: list[torch.Tensor], lora_b: list[torch.Tensor],
                   proj: LoRAProj, step: LoRAStep, shape: PersistShape) -> None:
    """The persistent launch (see `lora_persist`) for one group of up to MAX_SLICES slices."""
    assert x.stride(1) == 1 and y.stride(1) == 1 and len(lora_a) == len(lora_b) == shape.constexprs["NUM_S"]
    num_sorted = step.sorted_tokens.numel()
    num_slices = len(lora_a)
    # Every read of it is of a partial written (and signalled) before it in the same launch.
    parts = lora_shrink.new_workspace(shape.split_k, num_sorted, num_slices, shape.lanes, device=x.device)
    counters = arrival_counters(x.device, step.num_tiles * shape.num_chunks + 1)
    pad = MAX_SLICES - num_slices
    args = (y, x, *(lora_a + [lora_a[0]] * pad), *(lora_b + [lora_b[0]] * pad), parts, counters, step.sorted_tokens,
            step.tiles, proj.rank, proj.row_start, proj.scale, *shape.scalars, shape.in_dim, x.stride(0), y.stride(0),
            num_sorted, shape.num_chunks, shape.lanes, shape.split_k, shape.k_per_split, step.num_tiles,
            shape.num_blocks)
    grid = (_grid_size(args, shape, x.device),)
    if x.device.type == "cuda":
        _persist_kernel[grid](*args, PHASES=3, **shape.constexprs)
    else:  # the interpreter runs programs one after another: no program may wait on a later one
        _persist_kernel[grid](*args, PHASES=1, **shape.constexprs)
        _persist_kernel[grid](*args, PHASES=2, **shape.constexprs)


def lora_persist(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    proj: LoRAProj,
    step: LoRAStep,
    slices: list[int],
    y_offsets: list[int],
    config: PersistConfig,
) -> None:
    """Triton: y[tok, off_j:off_j+d_j] += scale[a,s] * (x[tok] @ A_{a,s}^T) @ B_{a,s}^T, s = slices[j], a = slot of tok.

    x: [num_tokens, in_dim]; y: [num_tokens, total_width]; lora_a[j]: [num_rows, in_dim] and lora_b[j]:
    [num_rows, d_j], the pools of slice slices[j] (at most 3 slices); y_offsets[j]: its first column in y.
    Rows of tokens without adapter and slices of rank 0 are not touched. Reference: `lora_fused_torch`.
    """
    shape = plan_persist(x.shape[1], [b.shape[1] for b in lora_b], proj, step, slices, y_offsets, config, x.device,
                         x.dtype)
    launch_persist(y, x, lora_a, lora_b, proj, step, shape)
