"""LoRA expand of a fused q/k/v projection, the rotary embedding and the KV-cache write in one launch.

On a step of tall tiles (a prefill: `LoRAStep.block_m` > 16) the q/k/v LoRA expand reads and writes the whole
projection output once more only to add a rank-r delta, and the rotary kernel reads it again right after
(`fused.rotary_kv_cache_`). Here one program per (tile of one adapter's tokens, group of heads) loads each
head's base q, k or v rows, adds the tile's delta (scale x t @ B, rounded to the dtype as the expand rounds it),
rotates q and k as the rotary kernel does (the same rounded products), and stores q back in place and k, v into
the paged caches; k and v are not written back into the projection output (attention reads the caches). Tokens
without an adapter are rotated by `fused.rotary_kv_cache_` with its token mask, in a second launch only when the
step has such tokens.

A program takes HEADS_PER_PROGRAM heads of one of q, k, v and computes the tile's angles once for them; each head
is two [BLOCK_M, 16] x [16, head_dim / 2] products (its halves, which the rotation pairs): on tensor cores from
head_dim 32, on CUDA cores below (test models); head_dim is a power of two >= 16.
`expand_rotary_kv_torch_` is the reference: the expand (`lora_expand_torch`) then `fused.rotary_kv_cache_torch_`
on the adapted tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kubelora.kernels import fused
from kubelora.kernels.fused import rotary_cos_sin, rotate_rounded
from kubelora.kernels.lora import LoRAProj, LoRAStep
from kubelora.kernels.lora_config import BLOCK_R, dot_precision
from kubelora.kernels.lora_expand import lora_expand_torch
from kubelora.kernels.lora_launch import shared_launch
from kubelora.kernels.lora_tile import pick_slice, tile_tokens

# q, k and v: the three slices of the fused projection, in this order.
NUM_SLICES = 3
# Heads of one slice per program (the tile's cos and sin are computed once for them) and warps per program: the
# fastest of 1..8 heads and 4 or 8 warps at 2048-token steps of the 7B shape on an H200 (docs/kernels.md).
HEADS_PER_PROGRAM = 4
NUM_WARPS = 8


@triton.jit
def _adapted_head(y_row, t_rows, b_row, cols, lanes0, m_ok, rank, scale, width, HALF: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):
    """One head's two halves for the tile's tokens: base + scale * t @ B, rounded to the dtype as the expand stores
    it for the rotary kernel to read. y_row, b_row: the head's first column in the tile's rows of qkv and in B."""
    h_ok = m_ok[:, None]
    x1 = tl.load(y_row + cols[None, :], mask=h_ok, other=0.0)
    x2 = tl.load(y_row + HALF + cols[None, :], mask=h_ok, other=0.0)
    acc1 = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r_ok = (r0 + lanes0) < rank
        t = tl.load(t_rows + (r0 + lanes0)[None, :], mask=h_ok & r_ok[None, :], other=0.0, cache_modifier=".cg")
        t = (t * scale).to(x1.dtype)
        b_chunk = b_row + (r0 + lanes0)[:, None] * width + cols[None, :]
        b1 = tl.load(b_chunk, mask=r_ok[:, None], other=0.0)
        b2 = tl.load(b_chunk + HALF, mask=r_ok[:, None], other=0.0)
        if HALF >= 16:
            acc1 = tl.dot(t, b1, acc1, input_precision=PRECISION)
            acc2 = tl.dot(t, b2, acc2, input_precision=PRECISION)
        else:  # halves narrower than a tensor-core product: summed on CUDA cores
            acc1 += tl.sum(t.to(tl.float32)[:, :, None] * b1.to(tl.float32)[None, :, :], axis=1)
            acc2 += tl.sum(t.to(tl.float32)[:, :, None] * b2.to(tl.float32)[None, :, :], axis=1)
    return (x1.to(tl.float32) + acc1).to(x1.dtype), (x2.to(tl.float32) + acc2).to(x1.dtype)


@triton.jit
def _expand_rotary_kernel(
    qkv_ptr, bq_ptr, bk_ptr, bv_ptr, t_ptr, tiles_ptr, rank_ptr, row_ptr, scale_ptr, positions_ptr, inv_freq_ptr,
    key_cache_ptr, value_cache_ptr, slots_ptr, attention_scaling, meta_stride, qkv_stride, lanes, cache_slot_stride,
    num_heads, num_kv_heads,
    HEAD_DIM: tl.constexpr, HEADS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    SLOT_TILES: tl.constexpr, PRECISION: tl.constexpr,
):
    # Program (group of HEADS heads of one of q, k, v; tile). The tile's angles are computed once for the group.
    HALF: tl.constexpr = HEAD_DIM // 2
    group = tl.program_id(0)  # q head groups, then k's, then v's
    tile = tl.program_id(1)
    q_groups = tl.cdiv(num_heads, HEADS)
    kv_groups = tl.cdiv(num_kv_heads, HEADS)
    is_kv = group >= q_groups
    is_v = group >= q_groups + kv_groups
    j = tl.where(is_v, 2, tl.where(is_kv, 1, 0))  # the slice
    first_head = HEADS * tl.where(is_v, group - q_groups - kv_groups, tl.where(is_kv, group - q_groups, group))
    slice_heads = tl.where(is_kv, num_kv_heads, num_heads)
    width = slice_heads * HEAD_DIM
    y_col = tl.where(is_v, (num_heads + num_kv_heads) * HEAD_DIM, tl.where(is_kv, num_heads * HEAD_DIM, 0))
    b_ptr = pick_slice(j, bq_ptr, bk_ptr, bv_ptr, 3)
    offs_m = tl.arange(0, BLOCK_M)
    slot, start, count, tok = tile_tokens(tiles_ptr, tile, BLOCK_M, offs_m, SLOT_TILES)
    rank = tl.load(rank_ptr + slot * meta_stride + j)
    row = tl.load(row_ptr + slot * meta_stride + j)
    scale = tl.load(scale_ptr + slot * meta_stride + j)
    m_ok = offs_m < count
    cols = tl.arange(0, HALF)
    lanes0 = tl.arange(0, BLOCK_R)
    dtype = qkv_ptr.dtype.element_ty
    y_rows = qkv_ptr + tok.to(tl.int64)[:, None] * qkv_stride + y_col
    t_rows = t_ptr + ((start + offs_m) * 3 + j)[:, None] * lanes
    slots = tl.load(slots_ptr + tok, mask=m_ok, other=-1).to(tl.int64)
    cache_rows = slots[:, None] * cache_slot_stride + cols[None, :]  # + the head's first column
    cache_ok = (m_ok & (slots >= 0))[:, None]
    if is_v:
        for hh in range(HEADS):
            h = first_head + hh
            if h < slice_heads:
                v1, v2 = _adapted_head(y_rows + h * HEAD_DIM, t_rows, b_ptr + row * width + h * HEAD_DIM, cols,
                                       lanes0, m_ok, rank, scale, width, HALF, BLOCK_M, BLOCK_R, PRECISION)
                cache = value_cache_ptr + cache_rows + h * HEAD_DIM
                tl.store(cache, v1, mask=cache_ok)
                tl.store(cache + HALF, v2, mask=cache_ok)
    else:
        positions = tl.load(positions_ptr + tok, mask=m_ok, other=0).to(tl.float32)
        inv_freq = tl.load(inv_freq_ptr + cols)
        cos, sin = rotary_cos_sin(positions[:, None] * inv_freq[None, :], attention_scaling, dtype)
        for hh in range(HEADS):
            h = first_head + hh
            if h < slice_heads:
                v1, v2 = _adapted_head(y_rows + h * HEAD_DIM, t_rows, b_ptr + row * width + h * HEAD_DIM, cols,
                                       lanes0, m_ok, rank, scale, width, HALF, BLOCK_M, BLOCK_R, PRECISION)
                v1, v2 = v1.to(tl.float32), v2.to(tl.float32)
                out1 = rotate_rounded(v1, v2, cos, sin, -1.0, dtype)
                out2 = rotate_rounded(v2, v1, cos, sin, 1.0, dtype)
                if is_kv:
                    cache = key_cache_ptr + cache_rows + h * HEAD_DIM
                    tl.store(cache, out1, mask=cache_ok)
                    tl.store(cache + HALF, out2, mask=cache_ok)
                else:
                    q_row = y_rows + h * HEAD_DIM + cols[None, :]
                    tl.store(q_row, out1, mask=m_ok[:, None])
                    tl.store(q_row + HALF, out2, mask=m_ok[:, None])


def is_expand_rotary(proj: LoRAProj, step: LoRAStep, head_dim: int) -> bool:
    """Whether a q/k/v projection of this step takes `add_lora_rotary_kv_cache_`: tall tiles (a prefill; decode
    steps and their graphs keep the expand and the rotary kernel), every one of q, k and v adapted by some slot of
    the step (the shrink's output then holds all three slices), and heads of a power of two >= 16."""
    return (step.has_lora and step.block_m > 16 and len(proj.max_rank) == NUM_SLICES and min(proj.max_rank) > 0
            and head_dim >= 16 and head_dim & (head_dim - 1) == 0)


def _check(qkv, t, lora_b, step, num_heads, num_kv_heads, head_dim, key_cache, value_cache) -> None:
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and qkv.stride(1) == 1
    assert t.is_contiguous() and t.shape[:2] == (step.num_lora_tokens, NUM_SLICES) and t.shape[2] % BLOCK_R == 0
    assert [b.shape[1] for b in lora_b] == [num_heads * head_dim] + [num_kv_heads * head_dim] * 2
    assert all(b.is_contiguous() and b.dtype == qkv.dtype for b in lora_b)
    for cache in (key_cache, value_cache):
        assert cache.dtype == qkv.dtype and cache.is_contiguous() and cache.shape[-2:] == (num_kv_heads, head_dim)


def launch_expand_rotary(qkv: torch.Tensor, t: torch.Tensor, lora_b: list[torch.Tensor], proj: LoRAProj,
                         step: LoRAStep, num_heads: int, num_kv_heads: int, positions: torch.Tensor,
                         inv_freq: torch.Tensor, attention_scaling: float, key_cache: torch.Tensor,
                         value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Triton: `expand_rotary_kv_torch_` for the step's adapted tokens (tokens without an adapter untouched).

    qkv: [num_tokens, (num_heads + 2 num_kv_heads) head_dim], the base projection output (q, k, v side by side);
    t: [num_lora_tokens, 3, lanes] float32, the shrink's output for slices q, k, v; lora_b: the three B pools;
    positions, slot_mapping: [num_tokens] int64; caches: [num_blocks, block_size, num_kv_heads, head_dim].
    """
    head_dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    _check(qkv, t, lora_b, step, num_heads, num_kv_heads, head_dim, key_cache, value_cache)
    assert positions.dtype == torch.int64 and not slot_mapping.is_floating_point() and inv_freq.dtype == torch.float32
    if step.num_tiles == 0:
        return
    heads = HEADS_PER_PROGRAM
    constexprs = dict(HEAD_DIM=head_dim, HEADS=heads, BLOCK_M=step.block_m, BLOCK_R=BLOCK_R,
                      SLOT_TILES=step.is_slot_tiles, PRECISION=dot_precision(qkv.dtype), num_warps=NUM_WARPS,
                      num_stages=1)
    grid = (triton.cdiv(num_heads, heads) + 2 * triton.cdiv(num_kv_heads, heads), step.num_tiles)
    scalars = (float(attention_scaling), proj.rank.stride(0), qkv.stride(0), t.shape[2], key_cache.stride(-3),
               num_heads, num_kv_heads)
    launch = shared_launch(_expand_rotary_kernel, grid, constexprs, scalars[1:])
    launch(qkv, *lora_b, t, step.tiles, proj.rank, proj.b_rows, proj.scale, positions, inv_freq, key_cache,
           value_cache, slot_mapping, *scalars)


def expand_rotary_kv_torch_(qkv: torch.Tensor, t: torch.Tensor, lora_b: list[torch.Tensor], proj: LoRAProj,
                            step: LoRAStep, num_heads: int, num_kv_heads: int, positions: torch.Tensor,
                            inv_freq: torch.Tensor, attention_scaling: float, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Reference, same arguments: for each adapted token, its q/k/v row plus its LoRA delta (as `lora_expand_torch`
    adds it), then q rotated in place and the rotated k and v stored at its cache slot (`fused.rotary_kv_cache_torch_`);
    k and v in qkv and every token without an adapter are left as they were."""
    head_dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
    tokens = step.sorted_tokens
    full = qkv.clone()
    lora_expand_torch(full, t, lora_b, proj, step, [0, 1, 2], [0, q_dim, q_dim + kv_dim])
    rows = full[tokens]
    q = rows[:, :q_dim].reshape(-1, num_heads, head_dim)
    k = rows[:, q_dim : q_dim + kv_dim].reshape(-1, num_kv_heads, head_dim)
    v = rows[:, q_dim + kv_dim :].reshape(-1, num_kv_heads, head_dim)
    fused.rotary_kv_cache_torch_(q, k, v, positions[tokens], inv_freq, attention_scaling, key_cache, value_cache,
                                 slot_mapping[tokens])
    qkv[tokens, :q_dim] = q.reshape(-1, q_dim)


def add_lora_rotary_kv_cache_(qkv: torch.Tensor, x: torch.Tensor, lora_a: list[torch.Tensor],
                              lora_b: list[torch.Tensor], proj: LoRAProj, step: LoRAStep, num_heads: int,
                              num_kv_heads: int, positions: torch.Tensor, inv_freq: torch.Tensor,
                              attention_scaling: float, key_cache: torch.Tensor, value_cache: torch.Tensor,
                              slot_mapping: torch.Tensor) -> None:
    """A q/k/v projection's LoRA deltas, rotary and KV-cache write where `is_expand_rotary` holds (Triton): the step's
    shrink, `launch_expand_rotary`, and `fused.rotary_kv_cache_` for the tokens without an adapter if there are any.
    As `add_lora` then `fused.rotary_kv_cache_` on views of qkv, except that k and v in qkv stay the base's."""
    from kubelora.kernels.lora_shrink import launch_shrink
    from kubelora.kernels.lora_triton import step_groups

    (group,) = step_groups(x, lora_b, proj, step)
    assert group.slices == [0, 1, 2]
    t = launch_shrink(x, lora_a, proj, step, group.slices, group.config, shape=group.shrink)
    launch_expand_rotary(qkv, t, lora_b, proj, step, num_heads, num_kv_heads, positions, inv_freq, attention_scaling,
                         key_cache, value_cache, slot_mapping)
    if step.num_lora_tokens < qkv.shape[0]:
        head_dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        fused.rotary_kv_cache_(q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim),
                               v.view(-1, num_kv_heads, head_dim), positions, inv_freq, attention_scaling, key_cache,
                               value_cache, slot_mapping, skip_adapted=step.token_slots)
