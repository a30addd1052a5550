"""LoRA expand: each LoRA token's shrink row times its adapter's B, scaled and added into its y slices.

The Triton kernel and its PyTorch reference share one signature. One launch covers every slice of the
projection: the grid's column blocks run over the slices' widths laid end to end, so q, k and v of
different widths (GQA) or gate and up share one launch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from kubelora.kernels.lora import LoRAProj, LoRAStep
from kubelora.kernels.lora_config import (BLOCK_R, MAX_SLICES, KernelConfig, dot_precision, num_lanes, pad_slices,
                                         stack_factor)
from kubelora.kernels.lora_launch import RepeatLaunch, shared_launch
from kubelora.kernels.lora_tile import gdc_wait, select_slice, tile_tokens, uses_pdl


@triton.jit
def _b_chunk(b_rows, width, offs_r, rank, n_mask):
    # B rows offs_r of the adapter ([K, columns]; n_mask broadcasts to it); rows at or past its rank move no bytes.
    return tl.load(b_rows + offs_r[:, None] * width, mask=(offs_r < rank)[:, None] & n_mask, other=0.0)


@triton.jit
def _t_chunk(t_ptr, t_rows, offs_r, m_mask, rank):
    # t[:, offs_r] ([BLOCK_M, K] float32; m_mask broadcasts to it), through L2 only (.cg): the shrink launch wrote it.
    return tl.load(t_ptr + t_rows + offs_r[None, :], mask=m_mask & (offs_r < rank)[None, :], other=0.0,
                   cache_modifier=".cg")


@triton.jit
def _add_dot(acc, t, scale, b, PRECISION: tl.constexpr):
    return tl.dot((t * scale).to(b.dtype), b, acc, input_precision=PRECISION)


@triton.jit
def _b_chunks(b_rows, width, lanes0, rank, n_mask, BLOCK_R: tl.constexpr, N: tl.constexpr):
    # The first N (1..4) rank chunks of B; the unused ones repeat chunk 0 (never multiplied).
    b_c0 = _b_chunk(b_rows, width, lanes0, rank, n_mask)
    b_c1 = b_c0
    b_c2 = b_c0
    b_c3 = b_c0
    if N > 1:
        b_c1 = _b_chunk(b_rows, width, BLOCK_R + lanes0, rank, n_mask)
    if N > 2:
        b_c2 = _b_chunk(b_rows, width, 2 * BLOCK_R + lanes0, rank, n_mask)
    if N > 3:
        b_c3 = _b_chunk(b_rows, width, 3 * BLOCK_R + lanes0, rank, n_mask)
    return b_c0, b_c1, b_c2, b_c3


@triton.jit
def _t_chunks(t_ptr, t_rows, lanes0, m_mask, rank, BLOCK_R: tl.constexpr, N: tl.constexpr):
    # The first N rank chunks of t, requested together; the unused ones repeat chunk 0.
    t_c0 = _t_chunk(t_ptr, t_rows, lanes0, m_mask, rank)
    t_c1 = t_c0
    t_c2 = t_c0
    t_c3 = t_c0
    if N > 1:
        t_c1 = _t_chunk(t_ptr, t_rows, BLOCK_R + lanes0, m_mask, rank)
    if N > 2:
        t_c2 = _t_chunk(t_ptr, t_rows, 2 * BLOCK_R + lanes0, m_mask, rank)
    if N > 3:
        t_c3 = _t_chunk(t_ptr, t_rows, 3 * BLOCK_R + lanes0, m_mask, rank)
    return t_c0, t_c1, t_c2, t_c3


@triton.jit
def _add_chunks(acc, t_c0, t_c1, t_c2, t_c3, b_c0, b_c1, b_c2, b_c3, scale, rank, BLOCK_R: tl.constexpr,
                N: tl.constexpr, PRECISION: tl.constexpr):
    # acc += scale * t_c @ b_c for the first N chunks, each only below the adapter's own rank.
    acc = _add_dot(acc, t_c0, scale, b_c0, PRECISION)
    if N > 1:
        if rank > BLOCK_R:
            acc = _add_dot(acc, t_c1, scale, b_c1, PRECISION)
    if N > 2:
        if rank > 2 * BLOCK_R:
            acc = _add_dot(acc, t_c2, scale, b_c2, PRECISION)
    if N > 3:
        if rank > 3 * BLOCK_R:
            acc = _add_dot(acc, t_c3, scale, b_c3, PRECISION)
    return acc


@triton.jit
def _expand_kernel(
    y_ptr, b0_ptr, b1_ptr, b2_ptr, t_ptr, tiles_ptr, rank_ptr, row_ptr, scale_ptr, tcol_ptr, dora_ptr, bias_ptr,
    col0, col1, col2, meta_stride, width0, width1, width2, y_off0, y_off1, y_off2, first_nb1, first_nb2,
    y_stride, lanes,
    NUM_S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    SLOT_TILES: tl.constexpr, B_FIRST: tl.constexpr, USE_PDL: tl.constexpr,
    PRECISION: tl.constexpr, STACK: tl.constexpr, RED_Y: tl.constexpr, T_IN_Y: tl.constexpr,
    HAS_DORA: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    # Program (column block of one slice, tile of tokens of one slot). Which slice: by the column block.
    # STACK > 1 (tiles of at most BLOCK_M / STACK tokens): the BLOCK_M rows of the product are STACK column
    # sub-blocks of BLOCK_N / STACK columns for the tile's first BLOCK_M / STACK tokens, row = sub-block x
    # ROWS + token, and the rank dimension is STACK copies of the chunk's lanes, copy s multiplied only by the
    # rows of sub-block s (t is masked to zero elsewhere). One MMA then serves every column of the block
    # without computing or holding rows past the tile's tokens.
    # T_IN_Y (a staged shrink, kernels/lora_triton.py: add_lora_staged_triton): t is not the shrink launch's
    # [num_sorted, NUM_S, lanes] float32 buffer but columns of the projection's own output row: token tok's
    # shrink row for this slice starts at t_ptr + tok * lanes + tcol[slot, col] (lanes: that row's pitch).
    # HAS_DORA (some slot of the step is DoRA; never with RED_Y): a DoRA slot's tokens get g * (y + delta - b) + b,
    # g its output scales, held in the B pool's row dora[slot, col] - 1 (0: plain LoRA), b the bias (HAS_BIAS).
    ROWS: tl.constexpr = BLOCK_M // STACK
    SUB_N: tl.constexpr = BLOCK_N // STACK
    pid_n = tl.program_id(0)
    tile = tl.program_id(1)
    j, b_ptr, col, width, y_off, nb = select_slice(pid_n, b0_ptr, b1_ptr, b2_ptr, col0, col1, col2, width0, width1,
                                                    width2, y_off0, y_off1, y_off2, first_nb1, first_nb2, NUM_S)
    offs_m = tl.arange(0, BLOCK_M)
    if STACK == 1:
        q = offs_m  # the row's token within the tile
        lanes0 = tl.arange(0, BLOCK_R)  # the product's K: the chunk's rank lanes
    else:
        q = offs_m % ROWS
        lanes0 = tl.arange(0, STACK * BLOCK_R) % BLOCK_R  # STACK copies of the chunk's lanes
    slot, start, count, tok = tile_tokens(tiles_ptr, tile, BLOCK_M, q, SLOT_TILES)
    rank = tl.load(rank_ptr + slot * meta_stride + col)
    row = tl.load(row_ptr + slot * meta_stride + col)
    scale = tl.load(scale_ptr + slot * meta_stride + col)
    m_mask = (q < count)[:, None]
    if STACK == 1:
        y_cols = (nb * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
        b_cols = y_cols
    else:
        offs_n = tl.arange(0, SUB_N)
        y_cols = (nb * BLOCK_N + (offs_m // ROWS) * SUB_N)[:, None] + offs_n[None, :]
        k_sub = tl.arange(0, STACK * BLOCK_R) // BLOCK_R
        b_cols = (nb * BLOCK_N + k_sub * SUB_N)[:, None] + offs_n[None, :]
        m_mask = m_mask & ((offs_m // ROWS)[:, None] == k_sub[None, :])
    # y is loaded first so that its bytes are in flight while t and B arrive. Rows past the tile's tokens
    # and slices the adapter does not adapt (rank 0) are neither read nor written.
    y_rows = q < tl.where(rank > 0, count, 0)
    y_mask = y_rows[:, None] & (y_cols < width)
    y_ptrs = y_ptr + tok[:, None] * y_stride + y_off + y_cols
    if not RED_Y:
        y_old = tl.load(y_ptrs, mask=y_mask, other=0.0)
    acc = tl.zeros([BLOCK_M, SUB_N], dtype=tl.float32)
    if T_IN_Y:
        t_col = tl.load(tcol_ptr + slot * meta_stride + col)
        t_rows = (tok.to(tl.int64) * lanes + t_col)[:, None]
    else:
        t_rows = ((start + q) * NUM_S + j)[:, None] * lanes  # t: [num_sorted, NUM_S, lanes]
    n_mask = b_cols < width
    b_rows = b_ptr + row * width + b_cols
    r_first = 0
    if B_FIRST > 0:
        # The first B_FIRST rank chunks of B are requested before t: launched early (programmatic dependent
        # launch), metadata, y and these B rows load while the shrink still runs, and after the wait only t
        # is on the critical path. Rows past the adapter's rank are masked (no bytes).
        b_c0, b_c1, b_c2, b_c3 = _b_chunks(b_rows, width, lanes0, rank, n_mask, BLOCK_R, B_FIRST)
        if USE_PDL:  # launched early: t is complete once the whole shrink grid is
            gdc_wait()
        # All t chunks are requested at once (lanes past the rank move no bytes); each chunk's product is
        # computed only up to the adapter's own rank (a runtime branch per tile).
        t_c0, t_c1, t_c2, t_c3 = _t_chunks(t_ptr, t_rows, lanes0, m_mask, rank, BLOCK_R, B_FIRST)
        acc = _add_chunks(acc, t_c0, t_c1, t_c2, t_c3, b_c0, b_c1, b_c2, b_c3, scale, rank, BLOCK_R, B_FIRST,
                          PRECISION)
        r_first = B_FIRST * BLOCK_R
    elif USE_PDL:
        gdc_wait()
    # The rank loop runs to this adapter's own rank (rounded up to BLOCK_R), not the step's maximum.
    for r0 in range(r_first, rank, BLOCK_R):
        b = _b_chunk(b_rows, width, r0 + lanes0, rank, n_mask)
        t = _t_chunk(t_ptr, t_rows, r0 + lanes0, m_mask, rank)
        acc = _add_dot(acc, t, scale, b, PRECISION)
    if RED_Y:
        # KernelConfig.is_red_y: the delta is added in L2 (one atomic add per element of y, each element by one
        # program: deterministic), so no program waits on y's loads or holds y in registers.
        tl.atomic_add(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask, sem="relaxed")
    else:
        out = y_old.to(tl.float32) + acc
        if HAS_DORA:
            g_row = tl.load(dora_ptr + slot * meta_stride + col)
            if g_row > 0:
                g = tl.load(b_ptr + (g_row - 1) * width + y_cols, mask=y_mask, other=1.0).to(tl.float32)
                if HAS_BIAS:
                    bias = tl.load(bias_ptr + y_off + y_cols, mask=y_mask, other=0.0).to(tl.float32)
                    out = g * (out - bias) + bias
                else:
                    out = g * out
        tl.store(y_ptrs, out.to(y_old.dtype), mask=y_mask)


@dataclass(frozen=True)
class ExpandShape:
    """Host-side parameters of one expand launch, from sizes only: computed once per step, reused per layer."""

    scalars: tuple[int, ...]  # cols, meta_stride, widths, y offsets, first column block of slices 1 and 2
    launch: RepeatLaunch = field(compare=False)  # the grid, the constexprs and the compiled kernel once launched


def plan_expand(widths: list[int], proj: LoRAProj, step: LoRAStep, slices: list[int], y_offsets: list[int],
                config: KernelConfig, device: torch.device, dtype: torch.dtype, is_t_in_y: bool = False,
                has_bias: bool = False) -> ExpandShape:
    """The expand launch's host-side parameters (see `launch_expand`; is_t_in_y: `launch_expand_staged`;
    has_bias: the projection's bias is given, for DoRA's scale)."""
    assert 1 <= len(slices) <= MAX_SLICES and len(widths) == len(slices) == len(y_offsets)
    num_blocks = [triton.cdiv(w, config.block_n) for w in widths]
    first_nb = [sum(num_blocks[:j]) for j in range(MAX_SLICES)]
    use_pdl = uses_pdl(config.is_pdl, device)
    scalars = (*pad_slices(slices), proj.rank.stride(0), *pad_slices(widths), *pad_slices(y_offsets), first_nb[1],
               first_nb[2])
    num_chunks = num_lanes(proj, slices) // BLOCK_R
    constexprs = dict(
        NUM_S=len(slices), BLOCK_M=step.block_m, BLOCK_N=config.block_n, BLOCK_R=BLOCK_R,
        SLOT_TILES=step.is_slot_tiles, B_FIRST=min(config.b_first, num_chunks),
        USE_PDL=use_pdl, PRECISION=dot_precision(dtype), STACK=stack_factor(step, config),
        RED_Y=config.is_red_y and proj.dora_row is None, T_IN_Y=is_t_in_y, HAS_DORA=proj.dora_row is not None,
        HAS_BIAS=has_bias and proj.dora_row is not None, num_warps=config.expand_warps, num_stages=config.expand_stages,
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return ExpandShape(scalars, shared_launch(_expand_kernel, (sum(num_blocks), step.num_tiles), constexprs, scalars))


def launch_expand(
    y: torch.Tensor,
    t: torch.Tensor,
    lora_b: list[torch.Tensor],
    proj: LoRAProj,
    step: LoRAStep,
    slices: list[int],
    y_offsets: list[int],
    config: KernelConfig,
    shape: ExpandShape | None = None,
    bias: torch.Tensor | None = None,
) -> None:
    """Triton: y[tok, off_j:off_j+d_j] += scale[a,s] * t[i, j, :r] @ B_{a,s}^T, tok = sorted[i], s = slices[j].

    y: [num_tokens, total_width]; t: [num_lora_tokens, len(slices), lanes] from the shrink;
    lora_b[j]: [num_rows, d_j], the pool of slice slices[j]; y_offsets[j]: its first column in y.
    Rows of tokens without adapter and slices of rank 0 are not touched. With proj.dora_row, a DoRA slot's rows
    become g * (y + delta - bias) + bias in the same store (bias [total_width] or None).
    shape: this step's `plan_expand` result when the caller has it (config then unused).
    """
    if shape is None:
        shape = plan_expand([b.shape[1] for b in lora_b], proj, step, slices, y_offsets, config, y.device,
                            lora_b[0].dtype, has_bias=bias is not None)
    assert len(lora_b) == len(slices) and y.stride(1) == 1 and t.is_contiguous()
    shape.launch(y, *pad_slices(lora_b), t, step.tiles, proj.rank, proj.b_rows, proj.scale, proj.rank,
                 *_dora_args(proj, bias, y), *shape.scalars, y.stride(0), t.shape[2])


def _dora_args(proj: LoRAProj, bias: torch.Tensor | None, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dora table, bias) as the kernel takes them; stand-ins it never reads where there is no DoRA or bias."""
    return (proj.rank if proj.dora_row is None else proj.dora_row), (y if bias is None else bias)


def launch_expand_staged(
    y: torch.Tensor,
    width: int,
    lora_b: list[torch.Tensor],
    proj: LoRAProj,
    step: LoRAStep,
    slices: list[int],
    y_offsets: list[int],
    shape: ExpandShape,
    bias: torch.Tensor | None = None,
) -> None:
    """Triton: y[tok, off_j:off_j+d_j] += scale[a,s] * y[tok, width + t_col[a,s] : ... + r] @ B_{a,s}^T (DoRA's
    scale as `launch_expand`'s; shape planned with has_bias=bias is not None).

    y: [num_tokens, width + staged rows], the output of a matmul whose weight rows past `width` are the step's
    adapters' A rows (engine/adapters/staging.py), so its columns past `width` hold every token's shrink rows;
    proj.t_col[a, s]: where slot a's rows of slice s start among them. Only y[:, :width] is written.
    shape: `plan_expand(..., is_t_in_y=True)`.
    """
    assert len(lora_b) == len(slices) and y.stride(1) == 1 and proj.t_col is not None
    assert proj.t_col.stride() == proj.rank.stride()
    shape.launch(y, *pad_slices(lora_b), y[:, width:], step.tiles, proj.rank, proj.b_rows, proj.scale,
                 proj.t_col, *_dora_args(proj, bias, y), *shape.scalars, y.stride(0), y.stride(0))


def lora_expand_staged_torch(y: torch.Tensor, width: int, lora_b: list[torch.Tensor], proj: LoRAProj,
                             step: LoRAStep, slices: list[int], y_offsets: list[int]) -> None:
    """Reference of `launch_expand_staged` (same arguments, no shape): float32, added once into y."""
    has_slot = step.token_slots >= 0
    tokens = torch.nonzero(has_slot).flatten()
    slots = step.token_slots[tokens]
    t_all = y[:, width:]
    for s, b_pool, off in zip(slices, lora_b, y_offsets):
        for slot in torch.unique(slots).tolist():
            rank, row = int(proj.rank[slot, s]), int(proj.b_rows[slot, s])
            if rank == 0:
                continue
            toks = tokens[slots == slot]
            first = int(proj.t_col[slot, s])
            t = (t_all[toks, first : first + rank].float() * float(proj.scale[slot, s])).to(b_pool.dtype)
            delta = t.float() @ b_pool[row : row + rank].float()  # as the kernel: t scaled, rounded, then the dot
            cols = slice(off, off + b_pool.shape[1])
            y[toks, cols] = (y[toks, cols].float() + delta).to(y.dtype)


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

    Same arguments as `launch_expand` (config ignored, no shape); computes in float32, adds once into y.
    """
    tokens = step.sorted_tokens
    token_slot = step.token_slots[tokens]
    for j, (s, b_pool, off) in enumerate(zip(slices, lora_b, y_offsets)):
        for slot in range(step.num_slots):
            rank, row = int(proj.rank[slot, s]), int(proj.b_rows[slot, s])
            pos = torch.nonzero(token_slot == slot).flatten()
            if rank == 0 or pos.numel() == 0:
                continue
            delta = float(proj.scale[slot, s]) * (t[pos, j, :rank] @ b_pool[row : row + rank].float())
            cols = slice(off, off + b_pool.shape[1])
            y[tokens[pos], cols] = (y[tokens[pos], cols].float() + delta).to(y.dtype)
