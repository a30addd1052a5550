"""Paged attention over the engine's KV cache, reading K/V blocks in place through the block table.

Cache layout (engine/model/attention.py): per layer key/value `[num_blocks, block_size, num_kv_heads, head_dim]`;
position p of a sequence is row p % block_size of block `block_table[p // block_size]`. Query head h reads kv head
h // (num_heads / num_kv_heads). With a sliding window w a query at position q sees keys k with q - w < k <= q, and
positions before the window are never read (their blocks may be freed or reused). With a soft-cap c (Gemma 2) the
scaled scores s become c * tanh(s / c) before the mask. head_dim need not be a power of two (Phi-3-mini's 96): the
kernels pad it to one (BLOCK_D) and mask the columns past it.

Decode ("flash decoding"): one program per (context split, kv head, sequence) computes every query head of that kv
head, so each K/V byte is read once; the last split of a (sequence, kv head) to finish merges the splits by their
log-sum-exp (an arrival counter, kernels/arrivals.py), so a decode step is one launch a layer. The grid and all
constexprs depend on shapes only, never on context_lens, so a captured CUDA graph replays with new lengths and tables.
Prefill: one program per (head, BLOCK_M query tokens, sequence), online softmax over the KV tiles of its causal range.
Scores are kept in log2 units (scale * log2(e) folded in) so the kernels use exp2.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kubelora.kernels.arrivals import arrival_counters

LOG2E = 1.4426950408889634
TARGET_PROGRAMS_PER_SM = 2  # default decode splits aim at this many (sequence, kv head, split) programs per SM


@dataclass(frozen=True)
class AttentionTiles:
    """Launch knobs. block_n: keys per loop step (any power of two >= 16: several cache blocks through the table);
    block_m: query tokens per prefill program; is_dot: decode scores by tl.dot (GQA groups are padded to 16 rows)
    rather than a broadcast multiply-reduce, which needs a group of 1 (MHA)."""

    block_n: int = 64
    block_m: int = 128
    num_warps: int = 4
    num_stages: int = 2
    is_dot: bool = True

    def __post_init__(self) -> None:
        for name in ("block_n", "block_m"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")


def decode_tiles(group: int, head_dim: int, device: torch.device) -> AttentionTiles:
    """Decode defaults: MHA reduces on CUDA cores (a 16-row dot would be 15/16 padding); GQA groups use tl.dot."""
    if device.type != "cuda":  # the interpreter: small tiles keep it quick and put several tiles in a split
        return AttentionTiles(block_n=16, block_m=16, is_dot=group > 1)
    if group == 1 and head_dim <= 128:  # MHA: the padded tl.dot still beats the CUDA-core reduce (H200, 7B shape)
        return AttentionTiles(block_n=128, num_warps=4, num_stages=2, is_dot=True)
    return AttentionTiles(block_n=64 if head_dim <= 128 else 32, num_warps=4, num_stages=2, is_dot=group > 1)


def prefill_tiles(head_dim: int, device: torch.device) -> AttentionTiles:
    if device.type != "cuda":
        return AttentionTiles(block_n=16, block_m=16)
    if head_dim <= 128:
        return AttentionTiles(block_n=64, block_m=128, num_warps=8, num_stages=3)
    return AttentionTiles(block_n=32, block_m=64, num_warps=8, num_stages=2)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # H200: the interpreter only needs a shape-derived number
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, block_n: int, device: torch.device) -> int:
    """Splits so that num_seqs * num_kv_heads * splits ~ TARGET_PROGRAMS_PER_SM * SMs, at most one per key tile."""
    programs = num_seqs * num_kv_heads
    wanted = triton.cdiv(TARGET_PROGRAMS_PER_SM * _num_sms(device), programs)
    return max(1, min(wanted, triton.cdiv(max_context, block_n)))


@triton.jit
def _slot_rows(table_row_ptr, pos, is_kv, stride_kb, stride_kt, BLOCK_SIZE: tl.constexpr):
    """[BLOCK_N] element offsets of positions pos in the cache (kv head 0): block from the table, row in block."""
    block = tl.load(table_row_ptr + pos // BLOCK_SIZE, mask=is_kv, other=0).to(tl.int64)
    return block * stride_kb + (pos % BLOCK_SIZE).to(tl.int64) * stride_kt


@triton.jit
def _scores(s, scale_log2, softcap_log2, HAS_SOFTCAP: tl.constexpr):
    """q.k products -> log2-unit scores: scaled, then (HAS_SOFTCAP) c * tanh(s / c), the cap in log2 units too
    (c * tanh(x / c) * log2(e) = c' * tanh(x log2(e) / c'), c' = c log2(e)). tanh(t) = 2 / (1 + exp(-2t)) - 1:
    exact at both ends (exp overflows to inf: -1), a float32 ulp of 1 off near 0."""
    s = s * scale_log2
    if HAS_SOFTCAP:
        s = softcap_log2 * (2.0 / (1.0 + tl.exp(-2.0 * s / softcap_log2)) - 1.0)
    return s


@triton.jit
def _softmax_step(s, v, m, l, acc, IS_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """One online-softmax update: s [ROWS, BLOCK_N] log2 scores (-inf masked), v [BLOCK_N, D] -> (m, l, acc)."""
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    if IS_DOT:
        pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    else:
        pv = tl.sum(p[:, :, None] * v[None, :, :].to(tl.float32), 1)
    return m_new, l, acc * alpha[:, None] + pv


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, ctx_ptr, out_ptr, part_ptr, lse_ptr, arrivals_ptr, scale_log2, softcap_log2,
    window, num_splits, stride_qs, stride_qh, stride_kb, stride_kt, stride_kh, stride_table, stride_os, stride_oh,
    GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, IS_SPLIT: tl.constexpr,
    IS_DOT: tl.constexpr, PRECISION: tl.constexpr, SPLITS: tl.constexpr,
):
    split, kv_head, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(ctx_ptr + seq)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx - window, 0)  # the query sits at ctx - 1
    first_tile = lo // BLOCK_N
    num_tiles = tl.cdiv(ctx, BLOCK_N) - first_tile
    per_split = tl.cdiv(num_tiles, num_splits)
    tile_start = first_tile + split * per_split
    tile_end = tl.minimum(tile_start + per_split, first_tile + num_tiles)  # <= tile_start: an empty split

    offs_g, offs_d, offs_n = tl.arange(0, ROWS), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g
    is_row = offs_g < GROUP  # rows past the group pad the tl.dot to 16 rows
    is_d = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                mask=is_row[:, None] & is_d[None, :], other=0.0)
    m = tl.full([ROWS], -1e30, tl.float32)  # finite: a row that has seen no key never computes -inf - -inf
    l = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    table_row = table_ptr + seq.to(tl.int64) * stride_table
    for tile in range(tile_start, tile_end):
        pos = tile * BLOCK_N + offs_n
        is_kv = (pos >= lo) & (pos < ctx)
        rows = _slot_rows(table_row, pos, is_kv, stride_kb, stride_kt, BLOCK_SIZE) + kv_head * stride_kh
        k = tl.load(k_ptr + rows[:, None] + offs_d[None, :], mask=is_kv[:, None] & is_d[None, :], other=0.0)
        v = tl.load(v_ptr + rows[:, None] + offs_d[None, :], mask=is_kv[:, None] & is_d[None, :], other=0.0)
        if IS_DOT:
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        else:
            s = tl.sum(q[:, None, :].to(tl.float32) * k[None, :, :].to(tl.float32), 2)
        s = tl.where(is_kv[None, :], _scores(s, scale_log2, softcap_log2, HAS_SOFTCAP), float("-inf"))
        m, l, acc = _softmax_step(s, v, m, l, acc, IS_DOT, PRECISION)

    has_keys = l > 0
    o = acc / tl.where(has_keys, l, 1.0)[:, None]
    if IS_SPLIT:
        num_heads = GROUP * tl.num_programs(1)
        part = (seq * num_heads + heads) * num_splits + split  # [num_seqs, num_heads, num_splits]
        tl.store(lse_ptr + part, tl.where(has_keys, m + tl.log2(tl.where(has_keys, l, 1.0)), float("-inf")),
                 mask=is_row)
        tl.store(part_ptr + part[:, None] * BLOCK_D + offs_d[None, :], o, mask=is_row[:, None])
        # The last split of (sequence, kv head) to arrive merges them all (no second launch). The barrier makes
        # every thread's partial visible before the (release) atomic; that program resets the counter.
        tl.debug_barrier()
        counter = arrivals_ptr + seq * tl.num_programs(1) + kv_head
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        if arrived == num_splits - 1:
            for g in tl.static_range(GROUP):
                _merge_splits(part_ptr, lse_ptr, out_ptr, seq, kv_head * GROUP + g, num_heads, num_splits,
                              stride_os, stride_oh, HEAD_DIM, BLOCK_D, SPLITS)
            tl.store(counter, 0)
    else:
        out = out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out, o.to(out_ptr.dtype.element_ty), mask=is_row[:, None] & is_d[None, :])


@triton.jit
def _merge_splits(part_ptr, lse_ptr, out_ptr, seq, head, num_heads, num_splits, stride_os, stride_oh,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr):
    """out[seq, head] = the splits' partial outputs weighted by their log-sum-exp (read through L2: other programs
    of the launch wrote them)."""
    offs_s, offs_d = tl.arange(0, SPLITS), tl.arange(0, BLOCK_D)
    is_split = offs_s < num_splits
    part = (seq * num_heads + head) * num_splits + offs_s
    lse = tl.load(lse_ptr + part, mask=is_split, other=float("-inf"), cache_modifier=".cg")
    top = tl.max(lse, 0)
    weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))  # empty splits (lse -inf) weigh 0
    o = tl.load(part_ptr + part[:, None] * BLOCK_D + offs_d[None, :], mask=is_split[:, None], other=0.0,
                cache_modifier=".cg")
    total = tl.sum(weight, 0)
    o = tl.sum(o * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@triton.jit
def _prefill_tile(q, m, l, acc, k_ptr, v_ptr, table_row, tile, q_pos, lo, ctx, window, kv_off, scale_log2,
                  softcap_log2, stride_kb, stride_kt, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  HAS_SOFTCAP: tl.constexpr, IS_MASKED: tl.constexpr, PRECISION: tl.constexpr):
    """One key tile for a [BLOCK_M, D] query block; unmasked tiles lie wholly before every row's position."""
    offs_n, offs_d = tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    pos = tile * BLOCK_N + offs_n
    is_kv = (pos >= lo) & (pos < ctx)
    is_d = offs_d < HEAD_DIM
    rows = _slot_rows(table_row, pos, is_kv, stride_kb, stride_kt, BLOCK_SIZE) + kv_off
    if IS_MASKED:
        k = tl.load(k_ptr + rows[:, None] + offs_d[None, :], mask=is_kv[:, None] & is_d[None, :], other=0.0)
        v = tl.load(v_ptr + rows[:, None] + offs_d[None, :], mask=is_kv[:, None] & is_d[None, :], other=0.0)
    else:
        k = tl.load(k_ptr + rows[:, None] + offs_d[None, :], mask=is_d[None, :], other=0.0)
        v = tl.load(v_ptr + rows[:, None] + offs_d[None, :], mask=is_d[None, :], other=0.0)
    s = _scores(tl.dot(q, tl.trans(k), input_precision=PRECISION), scale_log2, softcap_log2, HAS_SOFTCAP)
    if IS_MASKED:
        visible = is_kv[None, :] & (pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    return _softmax_step(s, v, m, l, acc, True, PRECISION)


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, start_ptr, qlen_ptr, ctx_ptr, out_ptr, scale_log2, softcap_log2, window,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_table, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
):
    head, q_block, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_len = tl.load(qlen_ptr + seq)
    m0 = q_block * BLOCK_M
    if m0 >= q_len:
        return
    tok0 = tl.load(start_ptr + seq).to(tl.int64)
    ctx = tl.load(ctx_ptr + seq)
    first_pos = ctx - q_len + m0  # position of the block's first query row
    offs_m, offs_d = m0 + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
    is_q = offs_m < q_len
    is_qd = is_q[:, None] & (offs_d < HEAD_DIM)[None, :]
    q_pos = ctx - q_len + offs_m
    q = tl.load(q_ptr + (tok0 + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=is_qd,
                other=0.0)
    m = tl.full([BLOCK_M], -1e30, tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0)
    first_tile = lo // BLOCK_N
    full_end = tl.maximum((first_pos + 1) // BLOCK_N, first_tile)  # tiles before it are visible to every row
    last_tile = tl.cdiv(tl.minimum(first_pos + BLOCK_M, ctx), BLOCK_N)
    table_row = table_ptr + seq.to(tl.int64) * stride_table
    kv_off = (head // GROUP) * stride_kh
    for tile in range(first_tile, full_end):
        m, l, acc = _prefill_tile(q, m, l, acc, k_ptr, v_ptr, table_row, tile, q_pos, lo, ctx, window, kv_off,
                                  scale_log2, softcap_log2, stride_kb, stride_kt, HEAD_DIM, BLOCK_D, BLOCK_SIZE,
                                  BLOCK_N, HAS_WINDOW, HAS_SOFTCAP, HAS_WINDOW, PRECISION)
    for tile in range(full_end, last_tile):
        m, l, acc = _prefill_tile(q, m, l, acc, k_ptr, v_ptr, table_row, tile, q_pos, lo, ctx, window, kv_off,
                                  scale_log2, softcap_log2, stride_kb, stride_kt, HEAD_DIM, BLOCK_D, BLOCK_SIZE,
                                  BLOCK_N, HAS_WINDOW, HAS_SOFTCAP, True, PRECISION)
    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    out = out_ptr + (tok0 + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(out, o.to(out_ptr.dtype.element_ty), mask=is_qd)


def _check_cache(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> int:
    """The GQA group size; the kernels take one set of cache strides for key and value."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    assert key_cache.shape == value_cache.shape and key_cache.stride() == value_cache.stride()
    assert key_cache.shape[3] == head_dim and num_heads % num_kv_heads == 0
    assert query.stride(2) == 1 and key_cache.stride(3) == 1
    assert key_cache.dtype == value_cache.dtype == query.dtype
    return num_heads // num_kv_heads


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # float32 exact (tests); bf16/fp16 ignore it


def launch_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, scale: float, window: int | None, out: torch.Tensor | None,
                  num_splits: int | None, tiles: AttentionTiles | None, softcap: float | None = None) -> torch.Tensor:
    """`paged_decode_attention` with explicit tiles (None: `decode_tiles`); launches from shapes only."""
    group = _check_cache(query, key_cache, value_cache)
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    tiles = tiles or decode_tiles(group, head_dim, query.device)
    if not tiles.is_dot and group > 1:
        raise ValueError(f"is_dot=False needs one query head per kv head, got {group}")
    max_context = block_tables.shape[1] * block_size
    num_splits = num_splits or default_num_splits(num_seqs, num_kv_heads, max_context, tiles.block_n, query.device)
    out = torch.empty_like(query) if out is None else out
    is_split = num_splits > 1
    part = lse = out  # unused unless split
    arrivals = context_lens
    if is_split:  # caching-allocator memory: safe under graph capture (the capture pool)
        part = torch.empty(num_seqs, num_heads, num_splits, triton.next_power_of_2(head_dim), dtype=torch.float32,
                           device=query.device)
        lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
        arrivals = arrival_counters(query.device, num_seqs * num_kv_heads, "decode_attention")
    rows = max(16, triton.next_power_of_2(group)) if tiles.is_dot else 1
    _decode_kernel[(num_splits, num_kv_heads, num_seqs)](
        query, key_cache, value_cache, block_tables, context_lens, out, part, lse, arrivals, scale * LOG2E,
        (softcap or 1.0) * LOG2E, window or 0, num_splits, query.stride(0), query.stride(1), *key_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1), GROUP=group, ROWS=rows, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size, BLOCK_N=tiles.block_n,
        HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None, IS_SPLIT=is_split, IS_DOT=tiles.is_dot,
        PRECISION=_precision(query.dtype), SPLITS=triton.next_power_of_2(num_splits), num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           window: int | None = None, out: torch.Tensor | None = None,
                           num_splits: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """out[s, h] = softmax_k(cap(scale * q[s, h] . K_s[k, h // G])) @ V_s[:, h // G], max(0, n_s - w) <= k < n_s.

    query, out: [num_seqs, num_heads, head_dim]; key_cache, value_cache: [num_blocks, block_size, num_kv_heads,
    head_dim]; block_tables: [num_seqs, max_blocks] int32; context_lens (n): [num_seqs] int32 >= 1, the new token's
    K/V already at position n - 1; G = num_heads / num_kv_heads; w: window (None: all); cap(s) = c * tanh(s / c)
    with c = softcap (None: cap(s) = s). CUDA-graph safe; num_splits None: from shapes (`default_num_splits`); splits
    past a sequence's context add nothing.
    """
    return launch_decode(query, key_cache, value_cache, block_tables, context_lens, scale, window, out, num_splits,
                         None, softcap)


def launch_prefill(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                   query_start_loc: torch.Tensor, seq_lens: torch.Tensor, context_lens: torch.Tensor,
                   max_query_len: int, scale: float, window: int | None, out: torch.Tensor | None,
                   tiles: AttentionTiles | None, softcap: float | None = None) -> torch.Tensor:
    """`paged_prefill_attention` with explicit tiles (None: `prefill_tiles`)."""
    group = _check_cache(query, key_cache, value_cache)
    num_heads, head_dim = query.shape[1:]
    tiles = tiles or prefill_tiles(head_dim, query.device)
    out = torch.empty_like(query) if out is None else out
    num_seqs = seq_lens.shape[0]
    grid = (num_heads, triton.cdiv(max_query_len, tiles.block_m), num_seqs)
    _prefill_kernel[grid](
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, context_lens, out, scale * LOG2E,
        (softcap or 1.0) * LOG2E, window or 0, query.stride(0), query.stride(1), *key_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1), GROUP=group, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=key_cache.shape[1], BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None,
        PRECISION=_precision(query.dtype), num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            context_lens: torch.Tensor, max_query_len: int, scale: float, window: int | None = None,
                            out: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """out[t, h] = softmax_k(cap(scale * q[t, h] . K_s[k, h // G])) @ V_s[:, h // G], p_t - w < k <= p_t, t in seq s.

    query, out: [num_tokens, num_heads, head_dim], sequence after sequence; key_cache, value_cache: [num_blocks,
    block_size, num_kv_heads, head_dim]; block_tables: [num_seqs, max_blocks] int32; query_start_loc: [num_seqs + 1]
    int32 (cumulative seq_lens); seq_lens: [num_seqs] int32 query lengths >= 1; context_lens (n): [num_seqs] int32
    positions including the new tokens, whose K/V are already cached; p_t = n_s - seq_lens[s] + (t -
    query_start_loc[s]); max_query_len: host int >= max(seq_lens), sizes the grid; w: window (None: causal only);
    cap(s) = c * tanh(s / c) with c = softcap (None: cap(s) = s).
    """
    return launch_prefill(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, context_lens,
                          max_query_len, scale, window, out, None, softcap)


def paged_prefill_attention_torch(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                  block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                                  context_lens: torch.Tensor, max_query_len: int, scale: float,
                                  window: int | None = None, out: torch.Tensor | None = None,
                                  softcap: float | None = None) -> torch.Tensor:
    """Reference of `paged_prefill_attention` (same math and shapes), in float32, one sequence at a time.

    Reads only positions inside the window of the sequence's first new token, as the kernel does.
    """
    num_kv_heads, head_dim = key_cache.shape[2:]
    block_size, group = key_cache.shape[1], query.shape[1] // num_kv_heads
    flat_key = key_cache.reshape(-1, num_kv_heads, head_dim)  # [num_blocks * block_size, num_kv_heads, head_dim]
    flat_value = value_cache.reshape(-1, num_kv_heads, head_dim)
    out = torch.empty_like(query) if out is None else out
    bounds = zip(query_start_loc.tolist(), seq_lens.tolist(), context_lens.tolist())  # host sync: CPU path, tests
    for seq, (start, q_len, ctx) in enumerate(bounds):
        lo = 0 if window is None else max(0, ctx - q_len - window + 1)
        k_pos = torch.arange(lo, ctx, device=query.device)
        slots = block_tables[seq, k_pos // block_size].long() * block_size + k_pos % block_size
        keys = flat_key[slots].float().repeat_interleave(group, 1)  # [num_keys, num_heads, head_dim]
        values = flat_value[slots].float().repeat_interleave(group, 1)
        q_pos = ctx - q_len + torch.arange(q_len, device=query.device)
        visible = k_pos[None, :] <= q_pos[:, None]
        if window is not None:
            visible &= k_pos[None, :] > q_pos[:, None] - window
        scores = torch.einsum("qhd,khd->hqk", query[start : start + q_len].float(), keys) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", probs, values).to(out.dtype)
    return out


def paged_decode_attention_torch(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                 window: int | None = None, out: torch.Tensor | None = None,
                                 num_splits: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Reference of `paged_decode_attention`: a prefill of one new token per sequence (num_splits has no effect)."""
    num_seqs = query.shape[0]
    starts = torch.arange(num_seqs + 1, dtype=torch.int32, device=query.device)
    ones = torch.ones(num_seqs, dtype=torch.int32, device=query.device)
    return paged_prefill_attention_torch(query, key_cache, value_cache, block_tables, starts, ones, context_lens, 1,
                                         scale, window, out, softcap)
