"""LoRA shrink: each LoRA token's input row times its adapter's A, at that adapter's own rank.

The Triton kernel and its PyTorch reference share one signature. Both work on the slot-sorted view of
the step (`LoRAStep.sorted_tokens`, `LoRAStep.tiles`) and write `t` in sorted order, so the expand reads
one tile's rows contiguously. The kernel splits the reduction over in_dim into `split_k` programs,
because a decode step has too few (tile, rank chunk) pairs to fill the GPU on its own; the last of them
to finish adds the partial sums. A program computes every slice of the projection, or one slice
(`KernelConfig.is_per_slice`: three times the programs, each a third of the work).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from kubelora.kernels.lora import LoRAProj, LoRAStep
from kubelora.kernels.lora_config import BLOCK_R, MAX_SLICES, MAX_SPLIT, KernelConfig, dot_precision, num_lanes
from kubelora.kernels.lora_launch import RepeatLaunch
from kubelora.kernels.lora_tile import (gdc_launch_dependents, l2_prefetch, pick_slice, sum_splits, tile_rows,
                                         uses_l2_prefetch, uses_pdl)


@triton.jit
def _shrink_dot(acc, x_tile, a_ptr, row_start, rank, offs_r, offs_k, k_mask, in_dim, PRECISION: tl.constexpr,
                ROWS: tl.constexpr):
    # A rows beyond the adapter's rank are masked: no bytes move for them, the lanes stay zero.
    a_mask = (offs_r < rank)[:, None] & k_mask[None, :]
    a = tl.load(a_ptr + (row_start + offs_r)[:, None] * in_dim + offs_k[None, :], mask=a_mask, other=0.0)
    if ROWS >= 16:
        return tl.dot(x_tile, tl.trans(a), acc, input_precision=PRECISION)
    # Fewer rows than a tensor-core tile takes: float32 products and a sum over the in_dim step, in registers.
    return acc + tl.sum(x_tile.to(tl.float32)[:, None, :] * a.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _store_slices(ptrs, lanes, acc0, acc1, acc2, mask0, mask1, mask2, NUM_S: tl.constexpr):
    # One [BLOCK_M, BLOCK_R] block per slice; slice j's lanes follow slice j-1's in a token's row.
    tl.store(ptrs, acc0, mask=mask0)
    if NUM_S > 1:
        tl.store(ptrs + lanes, acc1, mask=mask1)
    if NUM_S > 2:
        tl.store(ptrs + 2 * lanes, acc2, mask=mask2)


@triton.jit
def _prefetch_slice(b_ptr, width, row, rank, y_ptr, y_off, y_stride, tok, count, chunk, ks, split_k,
                    ROWS: tl.constexpr, BLOCK_R: tl.constexpr, PREFETCH: tl.constexpr, ESIZE: tl.constexpr):
    # What the expand will read of one slice, asked into L2 while this launch runs (KernelConfig.l2_prefetch):
    # the B rows of this rank chunk (contiguous: rank x width), a split_k-th per program, and with PREFETCH 2
    # the tile's y rows of the slice, every split_k-th token per program (chunk 0's programs only).
    r0 = chunk * BLOCK_R
    num_rows = tl.where(count > 0, tl.maximum(tl.minimum(rank - r0, BLOCK_R), 0), 0)
    l2_prefetch(b_ptr + (row + r0) * width, num_rows * width * ESIZE, ks, split_k)
    if PREFETCH > 1:
        offs_m = tl.arange(0, ROWS)
        y_count = tl.where((chunk == 0) & (rank > 0), count, 0)
        for m in range(ks, y_count, split_k):
            tok_m = tl.sum(tl.where(offs_m == m, tok, 0))
            l2_prefetch(y_ptr + tok_m * y_stride + y_off, width * ESIZE, 0, 1)


@triton.jit
def _shrink_tile(
    x_ptr, a0_ptr, a1_ptr, a2_ptr, sorted_ptr, tiles_ptr, rank_ptr, row_ptr, col0, col1, col2, meta_stride, in_dim,
    x_stride, tile, chunk, ks, k_per_split, split_k, b0_ptr, b1_ptr, b2_ptr, width0, width1, width2, y_ptr, y_off0,
    y_off1, y_off2, y_stride,
    NUM_S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    SLOT_TILES: tl.constexpr, FOLDED: tl.constexpr, PRECISION: tl.constexpr, PREFETCH: tl.constexpr,
    ESIZE: tl.constexpr, ROWS: tl.constexpr,
):
    """x[tile, K split ks] @ A_s[rank chunk]^T for every slice s: (acc0, acc1, acc2, start, count, rank0..2).

    acc_j: [ROWS, BLOCK_R] float32, the rank lanes chunk * BLOCK_R + [0, BLOCK_R) of slice j, rows past the tile's
    count and lanes past the slice's rank zero (ROWS: the tile height, or fewer where no tile has more tokens);
    start, count: the tile's rows in sorted order.
    """
    slot, start, count, tok = tile_rows(tiles_ptr, sorted_ptr, tile, BLOCK_M, ROWS, SLOT_TILES, FOLDED)
    offs_m = tl.arange(0, ROWS)
    m_mask = offs_m < count
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
    if PREFETCH > 0:
        _prefetch_slice(b0_ptr, width0, row0, rank0, y_ptr, y_off0, y_stride, tok, count, chunk, ks, split_k,
                        ROWS, BLOCK_R, PREFETCH, ESIZE)
        if NUM_S > 1:
            _prefetch_slice(b1_ptr, width1, row1, rank1, y_ptr, y_off1, y_stride, tok, count, chunk, ks, split_k,
                            ROWS, BLOCK_R, PREFETCH, ESIZE)
        if NUM_S > 2:
            _prefetch_slice(b2_ptr, width2, row2, rank2, y_ptr, y_off2, y_stride, tok, count, chunk, ks, split_k,
                            ROWS, BLOCK_R, PREFETCH, ESIZE)
    max_rank = tl.maximum(tl.maximum(rank0, rank1), rank2)
    k_lo = ks * k_per_split
    # A chunk past every slice's rank (a low-rank adapter in a high-rank step) runs no loop at all.
    k_hi = tl.where(chunk * BLOCK_R < max_rank, tl.minimum(k_lo + k_per_split, in_dim), k_lo)
    acc0 = tl.zeros([ROWS, BLOCK_R], dtype=tl.float32)
    acc1 = tl.zeros([ROWS, BLOCK_R], dtype=tl.float32)
    acc2 = tl.zeros([ROWS, BLOCK_R], dtype=tl.float32)
    x_rows = x_ptr + tok[:, None] * x_stride
    for k in range(k_lo, k_hi, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        x_tile = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc0 = _shrink_dot(acc0, x_tile, a0_ptr, row0, rank0, offs_r, offs_k, k_mask, in_dim, PRECISION, ROWS)
        if NUM_S > 1:
            acc1 = _shrink_dot(acc1, x_tile, a1_ptr, row1, rank1, offs_r, offs_k, k_mask, in_dim, PRECISION,
                               ROWS)
        if NUM_S > 2:
            acc2 = _shrink_dot(acc2, x_tile, a2_ptr, row2, rank2, offs_r, offs_k, k_mask, in_dim, PRECISION,
                               ROWS)
    return acc0, acc1, acc2, start, count, rank0, rank1, rank2


@triton.jit
def _shrink_kernel(
    x_ptr, a0_ptr, a1_ptr, a2_ptr, t_ptr, parts_ptr, arrivals_ptr, sorted_ptr, tiles_ptr, rank_ptr, row_ptr,
    col0, col1, col2, meta_stride, in_dim, x_stride, num_sorted, num_chunks, lanes, split_k, k_per_split,
    b0_ptr, b1_ptr, b2_ptr, width0, width1, width2, y_ptr, y_off0, y_off1, y_off2, y_stride,
    NUM_S: tl.constexpr, GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    SPLIT: tl.constexpr, SLOT_TILES: tl.constexpr, FOLDED: tl.constexpr, USE_PDL: tl.constexpr,
    PRECISION: tl.constexpr, PREFETCH: tl.constexpr, ESIZE: tl.constexpr, ROWS: tl.constexpr,
):
    # Program (tile, slice group, rank chunk of BLOCK_R lanes; K split). GROUPS 1: the group is every slice, so x
    # is read once per split; GROUPS NUM_S: one slice per program, three times the programs, each with a third
    # of the loads and products per in_dim step (docs/kernels.md, v7). program_id(0) is also the index of the
    # (tile, group, chunk) arrival counter, so one group's chunks are contiguous.
    if USE_PDL:  # the expand may start now: it loads its y and B while this launch runs
        gdc_launch_dependents()
    tile = tl.program_id(0) // (GROUPS * num_chunks)
    group = (tl.program_id(0) // num_chunks) % GROUPS
    chunk = tl.program_id(0) % num_chunks
    ks = tl.program_id(1)
    if GROUPS > 1:
        a_ptr = pick_slice(group, a0_ptr, a1_ptr, a2_ptr, NUM_S)
        col = pick_slice(group, col0, col1, col2, NUM_S)
        b_ptr = pick_slice(group, b0_ptr, b1_ptr, b2_ptr, NUM_S)
        width = pick_slice(group, width0, width1, width2, NUM_S)
        y_off = pick_slice(group, y_off0, y_off1, y_off2, NUM_S)
        acc0, acc1, acc2, start, count, rank0, rank1, rank2 = _shrink_tile(
            x_ptr, a_ptr, a_ptr, a_ptr, sorted_ptr, tiles_ptr, rank_ptr, row_ptr, col, col, col, meta_stride,
            in_dim, x_stride, tile, chunk, ks, k_per_split, split_k, b_ptr, b_ptr, b_ptr, width, width, width, y_ptr,
            y_off, y_off, y_off, y_stride, 1, BLOCK_M, BLOCK_K, BLOCK_R, SLOT_TILES, FOLDED, PRECISION, PREFETCH,
            ESIZE, ROWS)
    else:
        acc0, acc1, acc2, start, count, rank0, rank1, rank2 = _shrink_tile(
            x_ptr, a0_ptr, a1_ptr, a2_ptr, sorted_ptr, tiles_ptr, rank_ptr, row_ptr, col0, col1, col2, meta_stride,
            in_dim, x_stride, tile, chunk, ks, k_per_split, split_k, b0_ptr, b1_ptr, b2_ptr, width0, width1, width2,
            y_ptr, y_off0, y_off1, y_off2, y_stride, NUM_S, BLOCK_M, BLOCK_K, BLOCK_R, SLOT_TILES, FOLDED, PRECISION,
            PREFETCH, ESIZE, ROWS)
    # t and each partial plane: [num_sorted, NUM_S, lanes]; only lanes below each slice's rank are written. This
    # program's slices are group, group + 1, ...: PER of them.
    PER = NUM_S // GROUPS
    plane = num_sorted * NUM_S * lanes
    offs_m = tl.arange(0, ROWS)
    m_mask = offs_m < count
    offs_r = chunk * BLOCK_R + tl.arange(0, BLOCK_R)
    rows = ((start + offs_m) * NUM_S + group)[:, None] * lanes + offs_r[None, :]
    mask0 = m_mask[:, None] & (offs_r < rank0)[None, :]
    mask1 = m_mask[:, None] & (offs_r < rank1)[None, :]
    mask2 = m_mask[:, None] & (offs_r < rank2)[None, :]
    if SPLIT > 1:
        # Write this split's partial; the last split of the (tile, group, chunk) to arrive adds them all up.
        # The barrier makes every thread's partial visible before the (release) atomic; the arrival counter
        # is reset by that last program, ready for the next launch.
        _store_slices(parts_ptr + ks * plane + rows, lanes, acc0, acc1, acc2, mask0, mask1, mask2, PER)
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + tl.program_id(0), 1, sem="acq_rel")
        is_last = arrived == split_k - 1
        if is_last:
            acc0 = sum_splits(parts_ptr, rows, plane, split_k, mask0, SPLIT)
            if PER > 1:
                acc1 = sum_splits(parts_ptr, rows + lanes, plane, split_k, mask1, SPLIT)
            if PER > 2:
                acc2 = sum_splits(parts_ptr, rows + 2 * lanes, plane, split_k, mask2, SPLIT)
            tl.store(arrivals_ptr + tl.program_id(0), 0)
        # Only the last arrival writes t (a tile of no rows for the others).
        m_mask = offs_m < tl.where(is_last, count, 0)
    t_mask = m_mask[:, None]
    _store_slices(t_ptr + rows, lanes, acc0, acc1, acc2, t_mask & (offs_r < rank0)[None, :],
                  t_mask & (offs_r < rank1)[None, :], t_mask & (offs_r < rank2)[None, :], PER)


# KernelConfig.is_narrow_shrink: tiles of at most this many tokens skip the tensor cores (8 rows took 229 registers
# per thread at 256-wide in_dim steps, offline for sm_90; 4 rows 127, 2 rows 72).
NARROW_MAX_ROWS = 4

_arrivals: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device, size: int) -> torch.Tensor:
    """Per-device int32 counters, zero between launches (each launch's last arrivals reset theirs).

    Allocated once per device and grown when a step needs more; one stream at a time may use them.
    """
    counters = _arrivals.get(device)
    if counters is None or counters.numel() < size:
        counters = _arrivals[device] = torch.zeros(max(size, 4096), device=device, dtype=torch.int32)
    return counters


def new_workspace(*shape: int, device: torch.device) -> torch.Tensor:
    # Uninitialised on purpose: every read is of something written before (tests poison it through here).
    return torch.empty(shape, device=device, dtype=torch.float32)


def plan_split(in_dim: int, num_programs: int, config: KernelConfig, split_k: int | None) -> tuple[int, int]:
    """(split_k, k_per_split): enough K splits to reach config.target_programs, each a multiple of BLOCK_K."""
    if split_k is None:
        split_k = max(1, min(config.max_split, config.target_programs // max(num_programs, 1)))
    split_k = min(split_k, MAX_SPLIT)
    k_per_split = triton.cdiv(triton.cdiv(in_dim, split_k), config.block_k) * config.block_k
    return triton.cdiv(in_dim, k_per_split), k_per_split


@dataclass(frozen=True)
class ExpandTarget:
    """What the expand after a shrink will read, for the shrink to ask into L2 (`KernelConfig.l2_prefetch`)."""

    widths: list[int]  # the slices' B widths (= their widths in y)
    y_offsets: list[int]  # the slices' first columns in y
    b_dtype: torch.dtype  # of the B pools


@dataclass(frozen=True)
class ShrinkShape:
    """Host-side parameters of one shrink launch, from sizes only: computed once per step, reused per layer."""

    cols: tuple[int, int, int]  # the slices' columns in the proj tables, padded to MAX_SLICES
    in_dim: int
    num_sorted: int
    num_chunks: int
    lanes: int
    split_k: int
    k_per_split: int
    groups: int  # slice groups of the programs: 1 (all slices per program) or one per slice
    prefetch: tuple[int, ...]  # B widths and y offsets padded to MAX_SLICES (zeros without an L2 prefetch)
    launch: RepeatLaunch = field(compare=False)  # the grid, the constexprs and the compiled kernel once launched

    @property
    def is_prefetching(self) -> bool:
        return self.launch.constexprs["PREFETCH"] > 0


def plan_shrink(in_dim: int, proj: LoRAProj, step: LoRAStep, slices: list[int], config: KernelConfig,
                device: torch.device, dtype: torch.dtype, split_k: int | None = None,
                expand: ExpandTarget | None = None) -> ShrinkShape:
    """The shrink launch's host-side parameters (see `lora_shrink`).

    expand: what the following expand reads; with it (and config.l2_prefetch where the device has the
    instruction) the shrink's programs ask B, and with l2_prefetch 2 the tokens' y rows, into L2.
    """
    assert 1 <= len(slices) <= MAX_SLICES
    lanes = num_lanes(proj, slices)
    num_chunks = lanes // BLOCK_R
    groups = len(slices) if config.is_per_slice else 1
    split_k, k_per_split = plan_split(in_dim, step.num_tiles * groups * num_chunks, config, split_k)
    prefetch = config.l2_prefetch if expand is not None and uses_l2_prefetch(device) else 0
    esize = expand.b_dtype.itemsize if prefetch else 2
    if prefetch > 1 and esize != dtype.itemsize:
        prefetch = 1  # y's rows are sized by B's element size: only where the two are the same
    rows = step.block_m
    if config.is_narrow_shrink and 0 < step.max_tile_count <= NARROW_MAX_ROWS:
        rows = triton.next_power_of_2(step.max_tile_count)
    pad = MAX_SLICES - len(slices)
    scalars = (*(expand.widths + expand.widths[:1] * pad), *(expand.y_offsets + expand.y_offsets[:1] * pad)) \
        if prefetch else (0,) * (2 * MAX_SLICES)
    constexprs = dict(
        NUM_S=len(slices), GROUPS=groups, BLOCK_M=step.block_m, BLOCK_K=config.block_k, BLOCK_R=BLOCK_R,
        SPLIT=triton.next_power_of_2(split_k), SLOT_TILES=step.is_slot_tiles, FOLDED=config.is_folded,
        USE_PDL=uses_pdl(config.is_pdl, device), PRECISION=dot_precision(dtype), PREFETCH=prefetch, ESIZE=esize,
        ROWS=rows,
        num_warps=config.shrink_warps, num_stages=config.shrink_stages,
    )
    cols = tuple(slices + [slices[0]] * pad)
    grid = (step.num_tiles * groups * num_chunks, split_k)
    return ShrinkShape(cols, in_dim, step.sorted_tokens.numel(), num_chunks, lanes, split_k, k_per_split, groups,
                       scalars, RepeatLaunch(_shrink_kernel, grid, constexprs))


def launch_shrink(
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    proj: LoRAProj,
    step: LoRAStep,
    slices: list[int],
    config: KernelConfig,
    split_k: int | None = None,
    shape: ShrinkShape | None = None,
    y: torch.Tensor | None = None,
    lora_b: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """The shrink launch (see `lora_shrink`).

    shape: this step's `plan_shrink` result when the caller has it (config and split_k then unused).
    y, lora_b: the expand's output and B pools, read by a shape planned with an L2 prefetch.
    """
    if shape is None:
        shape = plan_shrink(x.shape[1], proj, step, slices, config, x.device, x.dtype, split_k)
    assert len(lora_a) == len(slices) and x.stride(1) == 1 and x.shape[1] == shape.in_dim
    num_slices = len(slices)
    t = new_workspace(shape.num_sorted, num_slices, shape.lanes, device=x.device)
    parts = new_workspace(shape.split_k if shape.split_k > 1 else 0, shape.num_sorted, num_slices, shape.lanes,
                          device=x.device)
    counters = arrival_counters(x.device, step.num_tiles * shape.groups * shape.num_chunks)
    pools = lora_a + [lora_a[0]] * (MAX_SLICES - num_slices)
    if shape.is_prefetching:
        assert y is not None and lora_b is not None and len(lora_b) == num_slices and y.stride(1) == 1
        b_pools, y_out = lora_b + [lora_b[0]] * (MAX_SLICES - num_slices), y
    else:
        b_pools, y_out = pools, x
    shape.launch(
        x, *pools, t, parts, counters, step.sorted_tokens, step.tiles, proj.rank, proj.row_start,
        *shape.cols, proj.rank.stride(0), shape.in_dim, x.stride(0), shape.num_sorted, shape.num_chunks, shape.lanes,
        shape.split_k, shape.k_per_split, *b_pools, *shape.prefetch[:MAX_SLICES], y_out,
        *shape.prefetch[MAX_SLICES:], y_out.stride(0),
    )
    return t


def lora_shrink(
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    proj: LoRAProj,
    step: LoRAStep,
    slices: list[int],
    config: KernelConfig,
    split_k: int | None = None,
) -> torch.Tensor:
    """Triton: t[i, j, :r] = x[sorted[i]] @ A_{a,s}^T, a = slot of sorted[i], s = slices[j], r = rank[a, s].

    x: [num_tokens, in_dim]; lora_a[j]: [num_rows, in_dim], the pool of slice slices[j] (at most 3 slices);
    returns t: [num_lora_tokens, len(slices), lanes] float32 in slot-sorted token order, lanes = the max
    rank rounded up to BLOCK_R. Lanes at or past a token's rank are not written; the expand never reads
    them. split_k (default: planned from config) splits the in_dim reduction over that many programs.
    """
    return launch_shrink(x, lora_a, proj, step, slices, config, split_k)


def lora_shrink_torch(
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    proj: LoRAProj,
    step: LoRAStep,
    slices: list[int],
    config: KernelConfig | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """Reference: t[i, j, :r] = x[sorted[i]] @ A_{a,s}^T, a = slot of sorted[i], s = slices[j], r = rank[a, s].

    Same arguments as `lora_shrink` (config and split_k ignored); computes in float32, lanes past the
    rank are zero.
    """
    lanes = num_lanes(proj, slices)
    tokens = step.sorted_tokens
    t = torch.zeros(tokens.numel(), len(slices), lanes, device=x.device, dtype=torch.float32)
    token_slot = step.token_slots[tokens]
    for j, (s, a_pool) in enumerate(zip(slices, lora_a)):
        for slot in range(step.num_slots):
            rank, row = int(proj.rank[slot, s]), int(proj.row_start[slot, s])
            pos = torch.nonzero(token_slot == slot).flatten()
            t[pos, j, :rank] = x[tokens[pos]].float() @ a_pool[row : row + rank].float().T
    return t
