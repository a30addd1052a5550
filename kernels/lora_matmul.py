"""A decode step's projection with its LoRA expand in the same launch: y = x W^T (+ b) + the batch's deltas.

At a decode step with adapters a projection is three launches: the matmul, the shrink (t = x A^T) and the expand
(y += scale t B^T), the expand reading and writing y again behind the matmul. Here the shrink runs first and one
launch streams W and adds the deltas: a program owns BLOCK_N output columns of all (at most BLOCK_M) tokens and
walks K in BLOCK_K chunks; each of its K iterations also takes the next TILES_PER_ITER tiles of the step (a tile
is one adapter's tokens, `LoRAStep.tiles`): it loads the tile's t rows and its adapter's B for the program's
columns and multiplies them, so the B loads ride in the same software pipeline as the weight loads. A tile's
product ([16 rows, BLOCK_N], rounded to the dtype as the expand rounds its delta) lands in the tokens' rows of a
[BLOCK_M, BLOCK_N] delta through a one-hot product (exact: each token is in one tile). The result is rounded
as the three-launch path rounds it: y = cast(cast(x W^T + b) + cast(delta)).

Taken by decode-shaped steps (`is_matmul_expand`: 16-row tiles, at most MAX_TOKENS tokens, every slice's width
a multiple of the column block); other steps keep the matmul + `add_lora`. `matmul_lora_torch` is the
reference with the same arguments.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kubelora.kernels.lora import TILE_HEAD, LoRAProj, LoRAStep, add_lora_torch
from kubelora.kernels.lora_config import MAX_SLICES, dot_precision, pad_slices
from kubelora.kernels.lora_tile import pick_slice

MAX_TOKENS = 64
TILE_M = 16
# (BLOCK_N, BLOCK_K, num_stages, num_warps); KUBELORA_MATMUL_EXPAND="n,k,stages,warps" overrides, "0" turns the
# fused launch off (the matmul + shrink + expand path).
CONFIG_ENV = "KUBELORA_MATMUL_EXPAND"
DEFAULT_CONFIG = (64, 128, 4, 4)
_HEAD = tl.constexpr(TILE_HEAD)


def launch_config() -> tuple[int, int, int, int] | None:
    """The launch's (BLOCK_N, BLOCK_K, num_stages, num_warps) from CONFIG_ENV, or None when it is "0"."""
    text = os.environ.get(CONFIG_ENV, "").strip()
    if text == "0":
        return None
    if not text:
        return DEFAULT_CONFIG
    values = tuple(int(v) for v in text.split(","))
    assert len(values) == 4, f"{CONFIG_ENV}: n,k,stages,warps"
    return values


@triton.jit
def _tile_delta(delta, tile, num_tiles, tiles_ptr, rank_ptr, row_ptr, scale_ptr, meta_stride, col, t_ptr, g,
                num_t_slices, lanes, b_ptr, width, b_cols, offs_m, SLOT_TILES: tl.constexpr, DTYPE: tl.constexpr,
                LANES: tl.constexpr, PRECISION: tl.constexpr):
    # delta[rows of the tile's tokens] += cast(scale * t[tile rows, g] @ B[adapter rows, b_cols]) for slice `col`
    # of the projection (its column of the rank/row/scale tables; g: its column of t). SLOT_TILES: tile i is slot i.
    # A tile past the step's, a slice not in t (g < 0) or an adapter of rank 0 there moves no bytes.
    q = tl.arange(0, 16)
    r = tl.arange(0, LANES)
    is_tile = (tile < num_tiles) & (g >= 0)
    g_col = tl.maximum(g, 0)
    head = tiles_ptr + tile * (_HEAD + 16)
    if SLOT_TILES:
        slot = tile
    else:
        slot = tl.load(head, mask=is_tile, other=0)
    start = tl.load(head + 1, mask=is_tile, other=0)
    count = tl.load(head + 2, mask=is_tile, other=0)
    tok = tl.load(head + _HEAD + q, mask=q < tl.where(is_tile, 16, 0), other=-1)
    rank = tl.load(rank_ptr + slot * meta_stride + col, mask=is_tile, other=0)
    row = tl.load(row_ptr + slot * meta_stride + col, mask=is_tile, other=0)
    scale = tl.load(scale_ptr + slot * meta_stride + col, mask=is_tile, other=0.0)
    r_ok = r < tl.where(count > 0, rank, 0)  # an empty tile (a graph's padding) reads no B
    q_ok = q < count
    t = tl.load(t_ptr + ((start + q) * num_t_slices + g_col)[:, None] * lanes + r[None, :],
                mask=q_ok[:, None] & r_ok[None, :], other=0.0, cache_modifier=".cg")
    b = tl.load(b_ptr + (row + r).to(tl.int64)[:, None] * width + b_cols[None, :], mask=r_ok[:, None] & (b_cols < width)[None, :],
                other=0.0)
    d = tl.dot((t * scale).to(DTYPE), b, input_precision=PRECISION).to(DTYPE)
    onehot = ((offs_m[:, None] == tok[None, :]) & q_ok[None, :]).to(DTYPE)
    return tl.dot(onehot, d, delta, input_precision=PRECISION)


@triton.jit
def _matmul_expand_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, t_ptr, tiles_ptr, rank_ptr, row_ptr, scale_ptr, b0_ptr, b1_ptr, b2_ptr,
    g0, g1, g2, width0, width1, width2, first_nb1, first_nb2, meta_stride, num_tokens, K, x_stride, w_stride,
    y_stride, num_t_slices, lanes, num_tiles,
    HAS_BIAS: tl.constexpr, NUM_S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, LANES: tl.constexpr, TILES_PER_ITER: tl.constexpr, SLOT_TILES: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # Program: BLOCK_N columns of y (of one slice: the blocks run over the slices laid end to end), all tokens.
    pid = tl.program_id(0)
    j = 0
    if NUM_S > 1:
        j = tl.where(pid >= first_nb1, 1, j)
    if NUM_S > 2:
        j = tl.where(pid >= first_nb2, 2, j)
    nb = pid - pick_slice(j, 0, first_nb1, first_nb2, NUM_S)
    g = pick_slice(j, g0, g1, g2, NUM_S)
    width = pick_slice(j, width0, width1, width2, NUM_S)
    b_ptr = pick_slice(j, b0_ptr, b1_ptr, b2_ptr, NUM_S)
    dtype = w_ptr.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of y and rows of W
    b_cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of the slice's B
    m_ok = offs_m < num_tokens
    x_ptrs = x_ptr + offs_m[:, None] * x_stride + offs_k[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * w_stride + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for it in range(0, tl.cdiv(K, BLOCK_K)):
        x = tl.load(x_ptrs, mask=m_ok[:, None] & (offs_k < BLOCK_K)[None, :], other=0.0)
        w = tl.load(w_ptrs)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        for u in tl.static_range(TILES_PER_ITER):
            delta = _tile_delta(delta, it * TILES_PER_ITER + u, num_tiles, tiles_ptr, rank_ptr, row_ptr, scale_ptr,
                                meta_stride, j, t_ptr, g, num_t_slices, lanes, b_ptr, width, b_cols, offs_m,
                                SLOT_TILES, dtype, LANES, PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
    y = (acc.to(dtype).to(tl.float32) + delta).to(dtype)
    tl.store(y_ptr + offs_m[:, None] * y_stride + cols[None, :], y, mask=m_ok[:, None] & (cols >= 0)[None, :])


def _group(proj: LoRAProj, num_slices: int) -> list[int]:
    return [s for s in range(num_slices) if proj.max_rank[s] > 0]


def is_matmul_expand(x: torch.Tensor, weight: torch.Tensor, lora_b: list[torch.Tensor], proj: LoRAProj,
                     step: LoRAStep) -> bool:
    """Whether `matmul_lora` takes this projection of this step: at most MAX_TOKENS tokens in 16-row tiles (a
    decode step's shape), at most MAX_SLICES slices whose widths the column block divides, K a
    multiple of the K block, and the fused launch not turned off (CONFIG_ENV)."""
    config = launch_config()
    if config is None or not step.has_lora or step.tiles is None:
        return False
    block_n, block_k = config[0], min(config[1], x.shape[1])
    widths = [b.shape[1] for b in lora_b]
    return (step.block_m == TILE_M and x.shape[0] <= MAX_TOKENS
            and len(lora_b) <= MAX_SLICES and sum(widths) == weight.shape[0] and weight.shape[1] == x.shape[1]
            and all(w % block_n == 0 for w in widths) and x.shape[1] % block_k == 0 and _group(proj, len(widths))
            and x.stride(1) == 1 and weight.is_contiguous())


def matmul_lora(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: list[torch.Tensor],
                lora_b: list[torch.Tensor], proj: LoRAProj, step: LoRAStep) -> torch.Tensor:
    """Triton: y = F.linear(x, weight, bias) with the step's LoRA deltas added (`add_lora`'s semantics), as the
    shrink launch and one launch for the matmul and the expands. Only where `is_matmul_expand` holds.

    x: [num_tokens, in_dim]; weight: [sum of the slices' widths, in_dim]; lora_a/lora_b: the slices' pools.
    """
    from kubelora.kernels.lora_shrink import launch_shrink
    from kubelora.kernels.lora_triton import step_groups

    block_n, block_k, num_stages, num_warps = launch_config()
    block_k = min(block_k, x.shape[1])
    groups = step_groups(x, lora_b, proj, step)
    assert len(groups) == 1
    group = groups[0]
    t = launch_shrink(x, [lora_a[s] for s in group.slices], proj, step, group.slices, group.config,
                      shape=group.shrink)
    widths = [b.shape[1] for b in lora_b]
    num_blocks = [w // block_n for w in widths]
    first_nb = [sum(num_blocks[:j]) for j in range(MAX_SLICES)]
    g = [group.slices.index(s) if s in group.slices else -1 for s in range(len(widths))]
    num_iters = x.shape[1] // block_k
    tiles_per_iter = triton.cdiv(step.num_tiles, num_iters)
    y = torch.empty(x.shape[0], weight.shape[0], device=x.device, dtype=x.dtype)
    block_m = max(16, triton.next_power_of_2(x.shape[0]))
    _matmul_expand_kernel[(sum(num_blocks),)](
        x, weight, bias if bias is not None else weight, y, t, step.tiles, proj.rank, proj.row_start, proj.scale,
        *pad_slices(list(lora_b)), *pad_slices(g), *pad_slices(widths), first_nb[1], first_nb[2],
        proj.rank.stride(0), x.shape[0], x.shape[1], x.stride(0), weight.stride(0), y.stride(0), t.shape[1],
        t.shape[2], step.num_tiles,
        HAS_BIAS=bias is not None, NUM_S=len(widths), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        LANES=max(16, triton.next_power_of_2(t.shape[2])), TILES_PER_ITER=tiles_per_iter, SLOT_TILES=step.is_slot_tiles,
        PRECISION=dot_precision(x.dtype), num_warps=num_warps, num_stages=num_stages)
    return y


def matmul_lora_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: list[torch.Tensor],
                      lora_b: list[torch.Tensor], proj: LoRAProj, step: LoRAStep) -> torch.Tensor:
    """Reference: F.linear(x, weight, bias), then `add_lora_torch` (same arguments as `matmul_lora`)."""
    y = F.linear(x, weight, bias)
    add_lora_torch(y, x, lora_a, lora_b, proj, step)
    return y
