"""LoRA shrink and expand of one projection in a single launch, for decode steps that take the GEMV shrink.

At batch 64 with 32..64 adapters of 1..2 tokens each, a projection's shrink and expand move a few MB each and
are bound by launch latency and the drain between the two launches, not by bandwidth. Here one grid holds both
kinds of work item: the GEMV shrink's (tile, slice, rank rows) items (`gemv_shrink_item`) first, then the
expand's (column block, tile) items (`expand_item`). A program takes the next ticket from an atomic counter
when it starts and works on that item, so every item with a lower ticket belongs to a program that is already
running: an expand item that waits for its (tile, slice) shrink rows waits only on programs that are resident
and wait on nothing themselves, and the grid cannot deadlock however the hardware schedules it. A shrink item
stores its rows of t, then adds one (release) to its (tile, slice) counter; an expand item loads its metadata
and B, spins (acquire) until that counter reaches the number of shrink items of the (tile, slice), then reads t
through L2. The last program to finish resets the counters for the next launch.

Same arguments and result as `launch_shrink` followed by `launch_expand`; `KernelConfig.is_one_launch` picks it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from kubelora.kernels.arrivals import arrival_counters
from kubelora.kernels.lora import LoRAProj, LoRAStep
from kubelora.kernels.lora_config import (BLOCK_R, MAX_SLICES, KernelConfig, dot_precision, num_lanes, pad_slices,
                                         stack_factor)
from kubelora.kernels.lora_expand import WAIT_COUNTER, expand_item
from kubelora.kernels.lora_launch import RepeatLaunch, shared_launch
from kubelora.kernels.lora_shrink import gemv_geometry, gemv_shrink_item, new_workspace, uses_gemv
from kubelora.kernels.lora_tile import gdc_wait, uses_pdl

# counters: [0] next ticket, [1] finished programs, [2:] one per (tile, slice): shrink items that wrote their rows
_HEAD = 2
_RESET_BLOCK = tl.constexpr(128)


@triton.jit
def _one_launch_kernel(
    x_ptr, a0_ptr, a1_ptr, a2_ptr, y_ptr, b0_ptr, b1_ptr, b2_ptr, t_ptr, counters_ptr, tiles_ptr,
    rank_ptr, row_ptr, scale_ptr, col0, col1, col2, meta_stride, in_dim, x_stride, num_groups, lanes,
    width0, width1, width2, y_off0, y_off1, y_off2, first_nb1, first_nb2, y_stride,
    num_shrink, num_blocks, num_programs, num_ready,
    NUM_S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr, RANKS: tl.constexpr,
    SLOT_TILES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, B_FIRST: tl.constexpr,
    PRECISION: tl.constexpr, STACK: tl.constexpr, RED_Y: tl.constexpr, EARLY: tl.constexpr,
):
    if EARLY:  # launched early behind the kernel before it (programmatic dependent launch): wait for it first
        gdc_wait()
    ticket = tl.atomic_add(counters_ptr, 1, sem="relaxed")
    ready_ptr = counters_ptr + 2
    if ticket < num_shrink:
        tile, j = gemv_shrink_item(x_ptr, a0_ptr, a1_ptr, a2_ptr, t_ptr, tiles_ptr, rank_ptr, row_ptr, col0, col1,
                                   col2, meta_stride, in_dim, x_stride, num_groups, lanes, ticket, NUM_S, BLOCK_M,
                                   BLOCK_K, ROWS, RANKS, SLOT_TILES, False)
        tl.debug_barrier()  # every thread's rows of t are stored before the (release) count
        tl.atomic_add(ready_ptr + tile * NUM_S + j, 1, sem="release")
    else:
        item = ticket - num_shrink
        expand_item(y_ptr, b0_ptr, b1_ptr, b2_ptr, t_ptr, tiles_ptr, rank_ptr, row_ptr, scale_ptr,
                    col0, col1, col2, meta_stride, width0, width1, width2, y_off0, y_off1, y_off2, first_nb1,
                    first_nb2, y_stride, lanes, item % num_blocks, item // num_blocks, ready_ptr, num_groups,
                    NUM_S, BLOCK_M, BLOCK_N, BLOCK_R, SLOT_TILES, B_FIRST, WAIT_COUNTER, PRECISION, STACK, RED_Y)
    finished = tl.atomic_add(counters_ptr + 1, 1, sem="acq_rel")
    if finished == num_programs - 1:  # every other program is done with the counters: zero them for the next launch
        tl.store(counters_ptr, 0)
        tl.store(counters_ptr + 1, 0)
        for first in range(0, num_ready, _RESET_BLOCK):
            offs = first + tl.arange(0, _RESET_BLOCK)
            tl.store(ready_ptr + offs, 0, mask=offs < num_ready)


@dataclass(frozen=True)
class OneLaunchShape:
    """Host-side parameters of one launch, from sizes only: computed once per step, reused per layer."""

    scalars: tuple[int, ...]  # cols, meta_stride, in_dim: the shrink's; widths, offsets, blocks: the expand's
    num_sorted: int
    lanes: int
    num_counters: int
    launch: RepeatLaunch = field(compare=False)


def uses_one_launch(step: LoRAStep, config: KernelConfig) -> bool:
    """The step's projection runs as one launch: config.is_one_launch on a step that takes the GEMV shrink."""
    return config.is_one_launch and uses_gemv(step, config)


def plan_one_launch(in_dim: int, widths: list[int], proj: LoRAProj, step: LoRAStep, slices: list[int],
                    y_offsets: list[int], config: KernelConfig, device: torch.device,
                    dtype: torch.dtype) -> OneLaunchShape:
    """The launch's grid and arguments: the GEMV shrink's items (config.gemv_*) then the expand's (block_n, b_first,
    stack_tokens, is_red_y), all programs of config.gemv_warps warps."""
    assert 1 <= len(slices) <= MAX_SLICES and len(widths) == len(slices) == len(y_offsets)
    rows, ranks, block_k, rank_groups = gemv_geometry(in_dim, proj, step, slices, config)
    num_blocks = [triton.cdiv(w, config.block_n) for w in widths]
    first_nb = [sum(num_blocks[:j]) for j in range(MAX_SLICES)]
    num_shrink = step.num_tiles * len(slices) * rank_groups
    num_programs = num_shrink + sum(num_blocks) * step.num_tiles
    num_ready = step.num_tiles * len(slices)
    lanes = num_lanes(proj, slices)
    early = uses_pdl(config.is_pdl and config.is_early_shrink, device)
    constexprs = dict(
        NUM_S=len(slices), BLOCK_M=step.block_m, BLOCK_K=block_k, ROWS=rows, RANKS=ranks,
        SLOT_TILES=step.is_slot_tiles, BLOCK_N=config.block_n, BLOCK_R=BLOCK_R,
        B_FIRST=min(config.b_first, lanes // BLOCK_R), PRECISION=dot_precision(dtype),
        STACK=stack_factor(step, config), RED_Y=config.is_red_y, EARLY=early,
        num_warps=config.gemv_warps, num_stages=1, **({"launch_pdl": True} if early else {}),
    )
    scalars = (*pad_slices(slices), proj.rank.stride(0), in_dim)
    expand_scalars = (*pad_slices(widths), *pad_slices(y_offsets), first_nb[1], first_nb[2])
    counts = (num_shrink, sum(num_blocks), num_programs, num_ready)
    num_sorted = step.sorted_tokens.numel()
    launch = shared_launch(_one_launch_kernel, (num_programs,), constexprs,
                           (*scalars, num_sorted, lanes, rank_groups, *expand_scalars, *counts))
    return OneLaunchShape((*scalars, rank_groups, lanes, *expand_scalars, *counts), num_sorted, lanes,
                          _HEAD + num_ready, launch)


def launch_one(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    proj: LoRAProj,
    step: LoRAStep,
    slices: list[int],
    y_offsets: list[int],
    config: KernelConfig,
    shape: OneLaunchShape | None = None,
) -> None:
    """Triton: y[tok, off_j:off_j+d_j] += scale[a,s] * (x[tok] @ A_{a,s}^T) @ B_{a,s}^T for the slices, one launch.

    Arguments as `launch_shrink` and `launch_expand` together; the step must take the GEMV shrink (`uses_gemv`).
    shape: this step's `plan_one_launch` result when the caller has it (config then unused).
    """
    if shape is None:
        assert uses_gemv(step, config), "the one-launch kernel runs the GEMV shrink: set gemv_rows"
        shape = plan_one_launch(x.shape[1], [b.shape[1] for b in lora_b], proj, step, slices, y_offsets, config,
                                x.device, lora_b[0].dtype)
    assert len(lora_a) == len(lora_b) == len(slices) and x.stride(1) == 1 and y.stride(1) == 1
    t = new_workspace(shape.num_sorted, len(slices), shape.lanes, device=x.device)
    counters = arrival_counters(x.device, shape.num_counters, "lora_one_launch")
    cols_meta_in = shape.scalars[:5]
    rank_groups, lanes = shape.scalars[5:7]
    rest = shape.scalars[7:]
    shape.launch(x, *pad_slices(lora_a), y, *pad_slices(lora_b), t, counters, step.tiles, proj.rank, proj.row_start,
                 proj.scale, *cols_meta_in, x.stride(0), rank_groups, lanes, *rest[:8], y.stride(0), *rest[8:])
