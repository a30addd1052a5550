"""Paged KV cache and attention over it.

Cache layout per layer: key/value `[num_blocks, block_size, num_kv_heads, head_dim]`; a token at position p of a
sequence lives in flat slot `block_table[p // block_size] * block_size + p % block_size`. This portable path
gathers each sequence's context into a padded batch and runs one SDPA for the whole step (`AttentionMetadata`).
Decode steps (one new token per sequence) carry `DecodeMetadata` instead: block tables and context lengths on
the device, read in place by `kernels/attention.py` (Triton on CUDA, its PyTorch reference elsewhere), with
every size fixed by the tensors' shapes so a CUDA graph replays it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step attention layout, built once by the runner (`prepare_attention`) and shared by all layers."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot each new token's K/V is written to
    query_index: torch.Tensor  # [num_seqs, max_query] int64: batch token index of each query row (pad: 0)
    token_rows: torch.Tensor  # [num_tokens] int64: row of each batch token in the flat [num_seqs * max_query]
    context_slots: torch.Tensor  # [num_seqs, max_context] int64: flat cache slot of each context position
    masks: dict[int | None, torch.Tensor]  # sliding window (None: full) -> [num_seqs, 1, max_query, max_context]


@dataclass(frozen=True)
class DecodeMetadata:
    """One new token per sequence; sequence i's context is positions [0, context_lens[i]) of its block table."""

    slot_mapping: torch.Tensor  # [num_seqs] int64: flat cache slot each new token's K/V is written to
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64: KV block of each block_size positions
    context_lens: torch.Tensor  # [num_seqs] int64: positions attended, the new token's included


@dataclass(frozen=True)
class PrefillMetadata:
    """Chunked prefill over the paged cache: sequence i adds seq_lens[i] tokens at the end of context_lens[i]."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64: first batch token of each sequence
    seq_lens: torch.Tensor  # [num_seqs] int64: new tokens
    context_lens: torch.Tensor  # [num_seqs] int64: positions attended, the new tokens included
    max_query_len: int
    # Rows past the sequences' tokens (a static prefill padded to its bucket): the kernels leave them unwritten,
    # so their output starts as zeros (finite values for the padding rows' later ops, which no real row reads)
    is_padded: bool = False


@dataclass
class KVCache:
    key: list[torch.Tensor]  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
    value: list[torch.Tensor]

    @classmethod
    def allocate(cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> KVCache:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return cls(key=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
                   value=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)])


def prepare_attention(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    windows: set[int | None],
    device: torch.device,
) -> AttentionMetadata:
    """Sequence i contributes query_lens[i] new tokens at the end of its context_lens[i] positions.

    Batch tokens are laid out sequence after sequence. Built with tensor ops (no loop over positions).
    """
    num_seqs = len(query_lens)
    max_query, max_context = max(query_lens), max(context_lens)
    max_blocks = max(len(t) for t in block_tables)
    tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in block_tables], dtype=torch.int64)
    q_lens = torch.tensor(query_lens, dtype=torch.int64)[:, None]  # [S, 1]
    c_lens = torch.tensor(context_lens, dtype=torch.int64)[:, None]
    k_pos = torch.arange(max_context)[None, :]  # [1, C]
    block_of = (k_pos // block_size).clamp(max=max_blocks - 1).expand(num_seqs, -1)
    context_slots = tables.gather(1, block_of) * block_size + k_pos % block_size
    context_slots = torch.where(k_pos < c_lens, context_slots, 0)  # [S, C]
    lanes = torch.arange(max_query)[None, :]  # [1, Q]
    is_query = lanes < q_lens  # [S, Q]
    q_pos = c_lens - q_lens + lanes  # [S, Q] position of each query row
    slot_mapping = context_slots.gather(1, q_pos.clamp(0, max_context - 1))[is_query]
    token_start = torch.cumsum(q_lens, 0) - q_lens
    query_index = torch.where(is_query, token_start + lanes, 0)
    causal = (k_pos[:, None, :] <= q_pos[..., None]) & (k_pos[:, None, :] < c_lens[..., None])  # [S, Q, C]
    pad_row = ~is_query[..., None] & (k_pos[:, None, :] == 0)  # padding rows attend to slot 0: no NaN
    masks = {}
    for window in windows:
        mask = causal if window is None else causal & (k_pos[:, None, :] > q_pos[..., None] - window)
        masks[window] = (mask | pad_row)[:, None].to(device)
    return AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        query_index=query_index.to(device),
        token_rows=torch.nonzero(is_query.flatten()).flatten().to(device),
        context_slots=context_slots.to(device),
        masks=masks,
    )


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key, value: [num_tokens, num_kv_heads, head_dim] stored at their flat slots."""
    num_kv_heads, head_dim = key.shape[1:]
    key_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = key
    value_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = value


def prepare_decode_attention(positions: list[int], block_tables: list[list[int]], block_size: int,
                             device: torch.device) -> DecodeMetadata:
    """Eager decode steps: each sequence's one new token at positions[i] (one host->device copy)."""
    num_seqs, max_blocks = len(positions), max(len(t) for t in block_tables)
    packed = np.zeros(num_seqs * (2 + max_blocks), dtype=np.int64)  # slots, context lengths, then the tables
    tables = packed[2 * num_seqs :].reshape(num_seqs, max_blocks)
    for row, (pos, table) in enumerate(zip(positions, block_tables)):
        packed[row] = table[pos // block_size] * block_size + pos % block_size
        packed[num_seqs + row] = pos + 1
        tables[row, : len(table)] = table
    dev = torch.from_numpy(packed).to(device)
    return DecodeMetadata(slot_mapping=dev[:num_seqs], block_tables=dev[2 * num_seqs :].view(num_seqs, max_blocks),
                          context_lens=dev[num_seqs : 2 * num_seqs])


def prepare_prefill_attention(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                              block_size: int, device: torch.device) -> PrefillMetadata:
    """Any step (prefill chunks and decode rows mixed) for the paged kernels, in one host->device copy."""
    num_seqs, max_blocks = len(query_lens), max(len(t) for t in block_tables)
    num_tokens = sum(query_lens)
    packed = np.zeros(num_tokens + 3 * num_seqs + 1 + num_seqs * max_blocks, dtype=np.int64)
    tables = packed[num_tokens + 3 * num_seqs + 1 :].reshape(num_seqs, max_blocks)
    token = 0
    for row, (q_len, ctx, table) in enumerate(zip(query_lens, context_lens, block_tables)):
        pos = np.arange(ctx - q_len, ctx)
        packed[token : token + q_len] = np.asarray(table)[pos // block_size] * block_size + pos % block_size
        tables[row, : len(table)] = table
        token += q_len
    packed[num_tokens : num_tokens + num_seqs] = query_lens
    packed[num_tokens + num_seqs : num_tokens + 2 * num_seqs] = context_lens
    packed[num_tokens + 2 * num_seqs + 1 : num_tokens + 3 * num_seqs + 1] = np.cumsum(query_lens)
    dev = torch.from_numpy(packed).to(device)
    first = num_tokens + 2 * num_seqs
    return PrefillMetadata(slot_mapping=dev[:num_tokens], block_tables=dev[first + num_seqs + 1 :].view(num_seqs, -1),
                           query_start_loc=dev[first : first + num_seqs + 1], seq_lens=dev[num_tokens : num_tokens + num_seqs],
                           context_lens=dev[num_tokens + num_seqs : first], max_query_len=max(query_lens))


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata | DecodeMetadata, window: int | None, scale: float) -> torch.Tensor:
    """query: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads * head_dim]."""
    if isinstance(meta, DecodeMetadata):
        return _decode_attention(query, key_cache, value_cache, meta, window, scale)
    if isinstance(meta, PrefillMetadata):
        return _prefill_attention(query, key_cache, value_cache, meta, window, scale)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    keys = key_cache.view(-1, num_kv_heads, head_dim)[meta.context_slots].transpose(1, 2)  # [S, kvh, C, d]
    values = value_cache.view(-1, num_kv_heads, head_dim)[meta.context_slots].transpose(1, 2)
    queries = query[meta.query_index].transpose(1, 2)  # [S, h, Q, d]
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.masks[window], scale=scale,
                                         enable_gqa=num_heads != num_kv_heads)  # [S, h, Q, d]
    out = out.transpose(1, 2).reshape(-1, num_heads * head_dim)  # [S * Q, h * d]
    return out[meta.token_rows]


def uses_triton(query: torch.Tensor) -> bool:
    """The Triton kernels on CUDA; their PyTorch references elsewhere (tests run the kernels under the interpreter)."""
    return query.is_cuda


def _decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: DecodeMetadata,
                      window: int | None, scale: float) -> torch.Tensor:
    from kubelora.kernels import attention  # imported late: TRITON_INTERPRET is read then

    kernel = attention.paged_decode_attention if uses_triton(query) else attention.paged_decode_attention_torch
    out = kernel(query, key_cache, value_cache, meta.block_tables, meta.context_lens, scale, window=window)
    return out.reshape(query.shape[0], -1)


def _prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: PrefillMetadata,
                       window: int | None, scale: float) -> torch.Tensor:
    from kubelora.kernels import attention

    kernel = attention.paged_prefill_attention if uses_triton(query) else attention.paged_prefill_attention_torch
    out = torch.zeros_like(query) if meta.is_padded else None
    out = kernel(query, key_cache, value_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                 meta.context_lens, meta.max_query_len, scale, window=window, out=out)
    return out.reshape(query.shape[0], -1)
