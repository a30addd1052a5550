"""LoRA shrink: each LoRA token's input row times its adapter's A, at that adapter's own rank.

The Triton kernel and its PyTorch reference share one signature. Both work on the slot-sorted view of
the step (`LoRAStep.sorted_tokens`, `LoRAStep.tiles`) and write `t` in sorted order, so the expand reads
one tile's rows contiguously. The kernel splits the reduction over in_dim into `split_k` programs,
because a decode step has too few (tile, rank chunk) pairs to fill the GPU on its own; the last of them
to finish adds the partial sums. A program computes every slice of the projection, or one slice
(`KernelConfig.is_per_slice`: three times the programs, each a third of the work). On steps whose tiles hold
a token or two (`KernelConfig.gemv_rows`), the GEMV kernel runs instead: one program per (tile, slice, a few
rank rows) over all of in_dim on CUDA cores, no K split.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from kubelora.kernels.arrivals import arrival_counters as shared_counters
from kubelora.kernels.lora import LoRAProj, LoRAStep
from kubelora.kernels.lora_config import (BLOCK_R, GEMV_PROGRAMS, MAX_SLICES, MAX_SPLIT, KernelConfig, dot_precision,
                                          num_lanes, pad_slices)
from kubelora.kernels.lora_launch import RepeatLaunch, shared_launch
from kubelora.kernels.lora_tile import (gdc_launch_dependents, gdc_wait, pick_slice, sum_splits, tile_meta, tile_rows,
                                       uses_pdl)


@triton.jit
def wait_predecessor():
    # A shrink launched early (KernelConfig.is_early_shrink: programmatic dependent launch behind whatever kernel
    # precedes it) has read only the step's metadata (host copies made before that kernel) so far. Wait for that
    # kernel to finish before reading x or writing anything, then let the expand launch: its y loads before its
    # own wait are then after every earlier kernel too.
    gdc_wait()
    gdc_launch_dependents()


@triton.jit
def _shrink_dot(acc, x_tile, a_ptr, row_start, rank, offs_r, offs_k, k_mask, in_dim, PRECISION: tl.constexpr):
    # A rows beyond the adapter's rank are masked: no bytes move for them, the lanes stay zero.
    a_mask = (offs_r < rank)[:, None] & k_mask[None, :]
    a = tl.load(a_ptr + (row_start + offs_r)[:, None] * in_dim + offs_k[None, :], mask=a_mask, other=0.0)
    return tl.dot(x_tile, tl.trans(a), acc, input_precision=PRECISION)


@triton.jit
def _store_slices(ptrs, lanes, acc0, acc1, acc2, mask0, mask1, mask2, NUM_S: tl.constexpr):
    # One [BLOCK_M, BLOCK_R] block per slice; slice j's lanes follow slice j-1's in a token's row.
    tl.store(ptrs, acc0, mask=mask0)
    if NUM_S > 1:
        tl.store(ptrs + lanes, acc1, mask=mask1)
    if NUM_S > 2:
        tl.store(ptrs + 2 * lanes, acc2, mask=mask2)


@triton.jit
def _shrink_tile(
    x_ptr, a0_ptr, a1_ptr, a2_ptr, tiles_ptr, rank_ptr, row_ptr, col0, col1, col2, meta_stride, in_dim,
    x_stride, tile, chunk, ks, k_per_split,
    NUM_S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    SLOT_TILES: tl.constexpr, PRECISION: tl.constexpr, EARLY: tl.constexpr,
):
    """x[tile, K split ks] @ A_s[rank chunk]^T for every slice s: (acc0, acc1, acc2, start, count, rank0..2).

    acc_j: [BLOCK_M, BLOCK_R] float32, the rank lanes chunk * BLOCK_R + [0, BLOCK_R) of slice j, rows past the
    tile's count and lanes past the slice's rank zero; start, count: the tile's rows in sorted order.
    """
    slot, start, count, tok = tile_meta(tiles_ptr, tile, BLOCK_M, SLOT_TILES)
    offs_m = tl.arange(0, BLOCK_M)
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
    max_rank = tl.maximum(tl.maximum(rank0, rank1), rank2)
    if EARLY:
        wait_predecessor()
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
    return acc0, acc1, acc2, start, count, rank0, rank1, rank2


@triton.jit
def _shrink_kernel(
    x_ptr, a0_ptr, a1_ptr, a2_ptr, t_ptr, parts_ptr, arrivals_ptr, tiles_ptr, rank_ptr, row_ptr,
    col0, col1, col2, meta_stride, in_dim, x_stride, num_sorted, num_chunks, lanes, split_k, k_per_split,
    NUM_S: tl.constexpr, GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    SPLIT: tl.constexpr, SLOT_TILES: tl.constexpr, USE_PDL: tl.constexpr,
    PRECISION: tl.constexpr, EARLY: tl.constexpr,
):
    # Program (tile, slice group, rank chunk of BLOCK_R lanes; K split). GROUPS 1: the group is every slice, so x
    # is read once per split; GROUPS NUM_S: one slice per program, three times the programs, each with a third
    # of the loads and products per in_dim step (docs/kernels.md). program_id(0) is also the index of the
    # (tile, group, chunk) arrival counter, so one group's chunks are contiguous.
    if USE_PDL and not EARLY:  # the expand may start now: it loads its y and B while this launch runs
        gdc_launch_dependents()
    tile = tl.program_id(0) // (GROUPS * num_chunks)
    group = (tl.program_id(0) // num_chunks) % GROUPS
    chunk = tl.program_id(0) % num_chunks
    ks = tl.program_id(1)
    if GROUPS > 1:
        a_ptr = pick_slice(group, a0_ptr, a1_ptr, a2_ptr, NUM_S)
        col = pick_slice(group, col0, col1, col2, NUM_S)
        acc0, acc1, acc2, start, count, rank0, rank1, rank2 = _shrink_tile(
            x_ptr, a_ptr, a_ptr, a_ptr, tiles_ptr, rank_ptr, row_ptr, col, col, col, meta_stride,
            in_dim, x_stride, tile, chunk, ks, k_per_split, 1, BLOCK_M, BLOCK_K, BLOCK_R, SLOT_TILES,
            PRECISION, EARLY)
    else:
        acc0, acc1, acc2, start, count, rank0, rank1, rank2 = _shrink_tile(
            x_ptr, a0_ptr, a1_ptr, a2_ptr, tiles_ptr, rank_ptr, row_ptr, col0, col1, col2, meta_stride,
            in_dim, x_stride, tile, chunk, ks, k_per_split, NUM_S, BLOCK_M, BLOCK_K, BLOCK_R, SLOT_TILES,
            PRECISION, EARLY)
    # t and each partial plane: [num_sorted, NUM_S, lanes]; only lanes below each slice's rank are written. This
    # program's slices are group, group + 1, ...: PER of them.
    PER = NUM_S // GROUPS
    plane = num_sorted * NUM_S * lanes
    offs_m = tl.arange(0, BLOCK_M)
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


@triton.jit
def _gemv_shrink_kernel(
    x_ptr, a0_ptr, a1_ptr, a2_ptr, t_ptr, tiles_ptr, rank_ptr, row_ptr, col0, col1, col2, meta_stride,
    in_dim, x_stride, num_groups, lanes,
    NUM_S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr, RANKS: tl.constexpr,
    SLOT_TILES: tl.constexpr, USE_PDL: tl.constexpr, EARLY: tl.constexpr,
):
    # Program (tile, slice, group of RANKS rank rows): t[tile's rows, slice, those lanes] over all of in_dim, as
    # [ROWS, RANKS, BLOCK_K] float32 products summed in registers (KernelConfig.gemv_rows: tiles of at most ROWS
    # tokens). Each program writes its own lanes of t: no K split, no partial sums, no arrival counters.
    if USE_PDL and not EARLY:  # the expand may start now: it loads its y and B while this launch runs
        gdc_launch_dependents()
    tile = tl.program_id(0) // (NUM_S * num_groups)
    j = (tl.program_id(0) // num_groups) % NUM_S
    group = tl.program_id(0) % num_groups
    a_ptr = pick_slice(j, a0_ptr, a1_ptr, a2_ptr, NUM_S)
    col = pick_slice(j, col0, col1, col2, NUM_S)
    slot, start, count, tok = tile_rows(tiles_ptr, tile, BLOCK_M, ROWS, SLOT_TILES)
    rank = tl.load(rank_ptr + slot * meta_stride + col)
    row = tl.load(row_ptr + slot * meta_stride + col)
    offs_m = tl.arange(0, ROWS)
    offs_r = group * RANKS + tl.arange(0, RANKS)
    m_mask = offs_m < count
    r_mask = offs_r < rank  # rows past the rank: masked, no bytes move (a group wholly past it loads nothing)
    if EARLY:
        wait_predecessor()
    x_rows = x_ptr + tok[:, None, None] * x_stride
    a_rows = a_ptr + (row + offs_r)[None, :, None] * in_dim
    acc = tl.zeros([ROWS, RANKS], dtype=tl.float32)
    for k in range(0, in_dim, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)[None, None, :]
        k_mask = offs_k < in_dim
        x = tl.load(x_rows + offs_k, mask=m_mask[:, None, None] & k_mask, other=0.0)
        a = tl.load(a_rows + offs_k, mask=r_mask[None, :, None] & k_mask, other=0.0)
        acc += tl.sum(x.to(tl.float32) * a.to(tl.float32), axis=2)
    t_rows = ((start + offs_m) * NUM_S + j)[:, None] * lanes + offs_r[None, :]
    tl.store(t_ptr + t_rows, acc, mask=m_mask[:, None] & r_mask[None, :])


def arrival_counters(device: torch.device, size: int) -> torch.Tensor:
    """The split shrink's arrival counters (kernels/arrivals.py), zero between launches."""
    return shared_counters(device, size, "lora_shrink")


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
    launch: RepeatLaunch = field(compare=False)  # the grid, the constexprs and the compiled kernel once launched
    rank_groups: int = 0  # the GEMV shrink's rank-row groups per (tile, slice); 0: the tensor-core shrink


def pdl_constexprs(config: KernelConfig, device: torch.device) -> dict:
    """USE_PDL (the expand is launched early) and EARLY (this launch too, behind the kernel before it)."""
    early = uses_pdl(config.is_pdl and config.is_early_shrink, device)
    return dict(USE_PDL=uses_pdl(config.is_pdl, device), EARLY=early, **({"launch_pdl": True} if early else {}))


def uses_gemv(step: LoRAStep, config: KernelConfig) -> bool:
    """The step takes the GEMV shrink: config.gemv_rows is set and no tile holds more tokens."""
    return 0 < step.max_tile_count <= config.gemv_rows


def plan_gemv(in_dim: int, proj: LoRAProj, step: LoRAStep, slices: list[int], config: KernelConfig,
              device: torch.device) -> ShrinkShape:
    """The GEMV shrink's launch (`_gemv_shrink_kernel`): one program per (tile, slice, group of rank rows).

    Its in_dim step keeps each thread's products (rows x ranks x its share of the step) to 128: 64..123
    registers per thread (offline, sm_90, triton 3.6; 256 products took 161).
    """
    rows = triton.next_power_of_2(step.max_tile_count)
    max_rank = max(proj.max_rank[s] for s in slices)
    ranks = config.gemv_ranks or next((r for r in (4, 2) if step.num_tiles * len(slices) * triton.cdiv(max_rank, r)
                                       >= GEMV_PROGRAMS), 1)
    budget = 128 * 32 * config.gemv_warps // (rows * ranks)
    block_k = min(config.gemv_k, triton.next_power_of_2(in_dim), 1 << (budget.bit_length() - 1))
    rank_groups = triton.cdiv(max_rank, ranks)
    constexprs = dict(
        NUM_S=len(slices), BLOCK_M=step.block_m, BLOCK_K=block_k, ROWS=rows, RANKS=ranks,
        SLOT_TILES=step.is_slot_tiles, **pdl_constexprs(config, device),
        num_warps=config.gemv_warps, num_stages=1,
    )
    grid = (step.num_tiles * len(slices) * rank_groups,)
    lanes = num_lanes(proj, slices)
    cols, num_sorted = tuple(pad_slices(slices)), step.sorted_tokens.numel()
    launch = shared_launch(_gemv_shrink_kernel, grid, constexprs, (*cols, in_dim, num_sorted, lanes, rank_groups))
    return ShrinkShape(cols, in_dim, num_sorted, lanes // BLOCK_R, lanes, 1, in_dim, len(slices), launch, rank_groups)


def plan_shrink(in_dim: int, proj: LoRAProj, step: LoRAStep, slices: list[int], config: KernelConfig,
                device: torch.device, dtype: torch.dtype, split_k: int | None = None) -> ShrinkShape:
    """The shrink launch's host-side parameters (see `launch_shrink`)."""
    assert 1 <= len(slices) <= MAX_SLICES
    if uses_gemv(step, config):
        return plan_gemv(in_dim, proj, step, slices, config, device)
    lanes = num_lanes(proj, slices)
    chunk = min(config.shrink_lanes, triton.next_power_of_2(lanes))  # rank lanes per program
    num_chunks = triton.cdiv(lanes, chunk)
    groups = len(slices) if config.is_per_slice else 1
    split_k, k_per_split = plan_split(in_dim, step.num_tiles * groups * num_chunks, config, split_k)
    constexprs = dict(
        NUM_S=len(slices), GROUPS=groups, BLOCK_M=step.block_m, BLOCK_K=config.block_k, BLOCK_R=chunk,
        SPLIT=triton.next_power_of_2(split_k), SLOT_TILES=step.is_slot_tiles, PRECISION=dot_precision(dtype),
        **pdl_constexprs(config, device),
        num_warps=config.shrink_warps, num_stages=config.shrink_stages,
    )
    grid = (step.num_tiles * groups * num_chunks, split_k)
    cols, num_sorted = tuple(pad_slices(slices)), step.sorted_tokens.numel()
    launch = shared_launch(_shrink_kernel, grid, constexprs, (*cols, in_dim, num_sorted, lanes, split_k, k_per_split))
    return ShrinkShape(cols, in_dim, num_sorted, num_chunks, lanes, split_k, k_per_split, groups, launch)


def launch_shrink(
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    proj: LoRAProj,
    step: LoRAStep,
    slices: list[int],
    config: KernelConfig,
    split_k: int | None = None,
    shape: ShrinkShape | None = None,
) -> torch.Tensor:
    """Triton: t[i, j, :r] = x[sorted[i]] @ A_{a,s}^T, a = slot of sorted[i], s = slices[j], r = rank[a, s].

    x: [num_tokens, in_dim]; lora_a[j]: [num_rows, in_dim], the pool of slice slices[j] (at most 3 slices);
    returns t: [num_lora_tokens, len(slices), lanes] float32 in slot-sorted token order, lanes = the max
    rank rounded up to BLOCK_R. Lanes at or past a token's rank are not written; the expand never reads
    them. split_k (default: planned from config) splits the in_dim reduction over that many programs (not
    on steps that take the GEMV kernel, which never splits it).
    shape: this step's `plan_shrink` result when the caller has it (config and split_k then unused).
    """
    if shape is None:
        shape = plan_shrink(x.shape[1], proj, step, slices, config, x.device, x.dtype, split_k)
    assert len(lora_a) == len(slices) and x.stride(1) == 1 and x.shape[1] == shape.in_dim
    num_slices = len(slices)
    t = new_workspace(shape.num_sorted, num_slices, shape.lanes, device=x.device)
    pools = pad_slices(lora_a)
    if shape.rank_groups:
        shape.launch(x, *pools, t, step.tiles, proj.rank, proj.row_start, *shape.cols,
                     proj.rank.stride(0), shape.in_dim, x.stride(0), shape.rank_groups, shape.lanes)
        return t
    parts = new_workspace(shape.split_k if shape.split_k > 1 else 0, shape.num_sorted, num_slices, shape.lanes,
                          device=x.device)
    counters = arrival_counters(x.device, step.num_tiles * shape.groups * shape.num_chunks)
    shape.launch(
        x, *pools, t, parts, counters, step.tiles, proj.rank, proj.row_start,
        *shape.cols, proj.rank.stride(0), shape.in_dim, x.stride(0), shape.num_sorted, shape.num_chunks, shape.lanes,
        shape.split_k, shape.k_per_split,
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
    """Reference: t[i, j, :r] = x[sorted[i]] @ A_{a,s}^T, a = slot of sorted[i], s = slices[j], r = rank[a, s].

    Same arguments as `launch_shrink` (config and split_k ignored, no shape); computes in float32, lanes past the
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
