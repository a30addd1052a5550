"""Paged KV cache and attention over it.

Cache layout per layer: key/value `[num_blocks, block_size, num_kv_heads, head_dim]`; a token at position p of a
sequence lives in flat slot `block_table[p // block_size] * block_size + p % block_size`. Every step reads the
cache in place through one `AttentionMetadata` (kernels/attention.py: Triton on CUDA, its PyTorch reference
elsewhere, so the CPU runs the same inputs): the decode kernel where each sequence adds one token, the prefill
kernel otherwise, every size fixed by the tensors' shapes so a CUDA graph replays it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """One step's attention over the paged cache, every step alike: sequence i adds seq_lens[i] new tokens (batch
    rows query_start_loc[i]..) at the end of its context_lens[i] positions, read through its block table. Views of
    the step's inputs (engine/step/inputs.py), shared by all layers."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot each new token's K/V is written to
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64: KV block of each block_size positions
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64: first batch row of each sequence
    seq_lens: torch.Tensor  # [num_seqs] int64: new tokens
    context_lens: torch.Tensor  # [num_seqs] int64: positions attended, the new tokens included
    max_query_len: int  # 1: one new token per sequence, which the decode kernel runs
    # Rows past the sequences' tokens (a step padded to its bucket): the prefill kernel leaves them unwritten, so
    # their output starts as zeros (finite values for the padding rows' later ops, which no real row reads)
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


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key, value: [num_tokens, num_kv_heads, head_dim] stored at their flat slots."""
    num_kv_heads, head_dim = key.shape[1:]
    key_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = key
    value_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = value


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, window: int | None, scale: float,
                    softcap: float | None = None) -> torch.Tensor:
    """query: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads * head_dim]; window: the layer's sliding
    window (None: full causal); softcap: scores -> softcap * tanh(scores / softcap) (None: none)."""
    if meta.max_query_len == 1:
        return _decode_attention(query, key_cache, value_cache, meta, window, scale, softcap)
    return _prefill_attention(query, key_cache, value_cache, meta, window, scale, softcap)


def uses_triton(query: torch.Tensor) -> bool:
    """The Triton kernels on CUDA; their PyTorch references elsewhere (tests run the kernels under the interpreter)."""
    return query.is_cuda


def _decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
                      window: int | None, scale: float, softcap: float | None) -> torch.Tensor:
    from kubelora.kernels import attention  # imported late: TRITON_INTERPRET is read then

    kernel = attention.paged_decode_attention if uses_triton(query) else attention.paged_decode_attention_torch
    out = kernel(query, key_cache, value_cache, meta.block_tables, meta.context_lens, scale, window=window,
                 softcap=softcap)
    return out.reshape(query.shape[0], -1)


def _prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
                       window: int | None, scale: float, softcap: float | None) -> torch.Tensor:
    from kubelora.kernels import attention

    kernel = attention.paged_prefill_attention if uses_triton(query) else attention.paged_prefill_attention_torch
    out = torch.zeros_like(query) if meta.is_padded else None
    out = kernel(query, key_cache, value_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                 meta.context_lens, meta.max_query_len, scale, window=window, out=out, softcap=softcap)
    return out.reshape(query.shape[0], -1)
