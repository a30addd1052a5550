"""Paged attention (kubelora.kernels.attention): Triton kernels against their PyTorch references, and the
references against SDPA and the engine's gather path. Without CUDA the kernels run under the interpreter at small
sizes; the `gpu` tests run bf16/fp16 at Llama-2-7B sizes, including a CUDA-graph replay, on the H200.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F

HAS_CUDA = torch.cuda.is_available()
TOLERANCE = {  # float32: the kernel and the reference differ only by summation order
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.bfloat16: {"rtol": 1e-2, "atol": 1e-2},
    torch.float16: {"rtol": 1e-2, "atol": 5e-3},
}
# (query tokens, context) per sequence: no prefix, prefix (chunked prefill), decode rows, several query blocks.
PREFILL_SEQS = [(7, 7), (5, 21), (1, 9), (33, 40), (1, 1)]
DECODE_CONTEXTS = [1, 5, 16, 17, 47]


@pytest.fixture
def attention():
    """The module built for the interpreter when there is no GPU (conftest sets TRITON_INTERPRET=1 first; a module
    imported earlier in the process without it is rebuilt)."""
    module = importlib.import_module("kubelora.kernels.attention")
    if not HAS_CUDA and type(module._decode_kernel).__name__ != "InterpretedFunction":
        module = importlib.reload(module)
    return module


def build_cache(context_lens: list[int], first_read: list[int], block_size: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype, device: str, seed: int, is_poisoned: bool = True):
    """(key_cache, value_cache [num_blocks, block_size, num_kv_heads, head_dim], block_tables [num_seqs, max_blocks]).

    Blocks are shuffled; block 0 is the null block padded graph rows point at; table entries past a sequence's blocks
    point at a spare block. Slots no query may read (spare and unowned blocks, past a context, before first_read[s])
    hold NaN, so a kernel that reads one fails the comparison.
    """
    gen = torch.Generator(device).manual_seed(seed)
    seq_blocks = [-(-n // block_size) for n in context_lens]
    num_blocks = 2 + sum(seq_blocks)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key, value = (torch.randn(shape, generator=gen, device=device) for _ in range(2))
    order = 1 + torch.randperm(num_blocks - 1, generator=gen, device=device).int()
    tables = torch.full((len(context_lens), max(seq_blocks) + 1), order[-1].item(), dtype=torch.int32, device=device)
    is_read = torch.zeros(num_blocks, block_size, dtype=torch.bool, device=device)
    is_read[0] = True
    offset = 0
    for seq, (num_positions, lo) in enumerate(zip(context_lens, first_read)):
        blocks = order[offset : offset + seq_blocks[seq]]
        offset += seq_blocks[seq]
        tables[seq, : len(blocks)] = blocks
        pos = torch.arange(lo, num_positions, device=device)
        is_read[blocks[pos // block_size].long(), pos % block_size] = True
    if is_poisoned:
        key[~is_read], value[~is_read] = math.nan, math.nan
    return key.to(dtype), value.to(dtype), tables


def decode_problem(context_lens, num_heads, num_kv_heads, head_dim, block_size, window, dtype, device, seed=0,
                   num_padded=0):
    """Arguments of paged_decode_attention, plus num_padded graph-padding rows (context 1, table of block 0)."""
    first_read = [0 if window is None else max(0, n - window) for n in context_lens]
    key, value, tables = build_cache(context_lens, first_read, block_size, num_kv_heads, head_dim, dtype, device, seed)
    tables = torch.cat([tables, torch.zeros(num_padded, tables.shape[1], dtype=torch.int32, device=device)])
    lens = torch.tensor(context_lens + [1] * num_padded, dtype=torch.int32, device=device)
    gen = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(device, dtype)
    return query, key, value, tables, lens, 2 / math.sqrt(head_dim)


def prefill_problem(seqs, num_heads, num_kv_heads, head_dim, block_size, window, dtype, device, seed=0,
                    is_poisoned=True):
    """Arguments of paged_prefill_attention for [(query tokens, context)] per sequence."""
    q_lens, context_lens = [q for q, _ in seqs], [n for _, n in seqs]
    first_read = [0 if window is None else max(0, n - q - window + 1) for q, n in seqs]
    key, value, tables = build_cache(context_lens, first_read, block_size, num_kv_heads, head_dim, dtype, device, seed,
                                     is_poisoned)
    to_int = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    starts = to_int([0] + torch.tensor(q_lens).cumsum(0).tolist())
    gen = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(device, dtype)
    return query, key, value, tables, starts, to_int(q_lens), to_int(context_lens), max(q_lens), 2 / math.sqrt(head_dim)


def check(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.dtype == expected.dtype and out.isfinite().all()
    torch.testing.assert_close(out, expected, **TOLERANCE[out.dtype])


HEADS = [(2, 2), (8, 2), (3, 1), (16, 1)]  # MHA; GQA groups of 4 and 3 (padded to 16 dot rows) and 16


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
def test_decode_matches_reference(attention, device, num_heads, num_kv_heads, block_size, window):
    args = decode_problem(DECODE_CONTEXTS, num_heads, num_kv_heads, 32, block_size, window, torch.float32, device)
    expected = attention.paged_decode_attention_torch(*args, window=window)
    for num_splits in (None, 1):  # None: 4 splits here (four 16-key tiles at most)
        check(attention.paged_decode_attention(*args, window=window, num_splits=num_splits), expected)


@pytest.mark.parametrize("num_splits", [2, 5, 16])
def test_decode_splits_past_the_context(attention, device, num_splits):
    """Splits of unequal tile counts, and more splits than key tiles (16 keys each under the interpreter):
    empty splits weigh nothing, no NaN."""
    from kubelora.kernels.arrivals import arrival_counters

    args = decode_problem([1, 3, 20, 47], 4, 2, 16, 4, None, torch.float32, device)
    for _ in range(2):  # the last arrivals reset their counters: a second launch merges as the first did
        check(attention.paged_decode_attention(*args, num_splits=num_splits),
              attention.paged_decode_attention_torch(*args))
        assert not arrival_counters(torch.device(device), 1, "decode_attention").any()


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_padded_graph_rows(attention, device, num_splits):
    """Rows of a padded CUDA-graph batch (context 1 on block 0) beside real rows: finite, and the real rows exact."""
    args = decode_problem([9, 30], 8, 2, 32, 4, None, torch.float32, device, num_padded=3)
    check(attention.paged_decode_attention(*args, num_splits=num_splits), attention.paged_decode_attention_torch(*args))


@pytest.mark.parametrize("tiles", [{"block_n": 32, "is_dot": True}, {"block_n": 32, "is_dot": False},
                                   {"block_n": 16, "is_dot": True}], ids=str)
@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_tiles(attention, device, tiles, block_size):
    """MHA by tl.dot (one row padded to 16) or by a multiply-reduce; a loop step of one or several cache blocks."""
    args = decode_problem(DECODE_CONTEXTS, 2, 2, 64, block_size, 9, torch.float32, device)
    out = attention.launch_decode(*args, 9, None, 2, attention.AttentionTiles(**tiles))
    check(out, attention.paged_decode_attention_torch(*args, window=9))


def test_decode_reduce_needs_mha(attention, device):
    args = decode_problem([5], 4, 2, 16, 4, None, torch.float32, device)
    with pytest.raises(ValueError, match="is_dot=False"):
        attention.launch_decode(*args, None, None, 1, attention.AttentionTiles(is_dot=False))


def test_decode_strided_query_and_out(attention, device):
    """query a slice of a fused qkv buffer, out a slice of a wider buffer: the kernels follow strides."""
    query, key, value, tables, lens, scale = decode_problem([6, 19], 4, 2, 16, 4, None, torch.float32, device)
    fused = torch.randn(2, 8, 16, device=device)
    fused[:, 2:6] = query
    wide = torch.zeros(2, 4, 32, device=device)
    attention.paged_decode_attention(fused[:, 2:6], key, value, tables, lens, scale, out=wide[..., :16], num_splits=2)
    check(wide[..., :16], attention.paged_decode_attention_torch(query, key, value, tables, lens, scale))
    assert (wide[..., 16:] == 0).all()


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2)])
def test_prefill_matches_reference(attention, device, num_heads, num_kv_heads, block_size, window):
    """Chunked prefill (prefix context), several query blocks and one-token rows mixed in."""
    args = prefill_problem(PREFILL_SEQS, num_heads, num_kv_heads, 32, block_size, window, torch.float32, device)
    check(attention.paged_prefill_attention(*args, window=window),
          attention.paged_prefill_attention_torch(*args, window=window))


@pytest.mark.parametrize("tiles", [{"block_n": 32, "block_m": 16}, {"block_n": 16, "block_m": 32}], ids=str)
def test_prefill_tiles(attention, device, tiles):
    args = prefill_problem(PREFILL_SEQS, 2, 1, 16, 4, None, torch.float32, device)
    out = attention.launch_prefill(*args, None, None, attention.AttentionTiles(**tiles))
    check(out, attention.paged_prefill_attention_torch(*args))


@pytest.mark.parametrize("window", [None, 5])
def test_prefill_reference_matches_sdpa(attention, window):
    """On whole sequences in order (no prefix) the reference is SDPA with a causal (and window) mask."""
    seqs, num_heads, num_kv_heads, head_dim = [(12, 12), (20, 20)], 4, 2, 16
    query, key, value, tables, *lens, scale = prefill_problem(seqs, num_heads, num_kv_heads, head_dim, 4, window,
                                                              torch.float32, "cpu", is_poisoned=False)
    out = attention.paged_prefill_attention_torch(query, key, value, tables, *lens, scale, window=window)
    start = 0
    for seq, (n, _) in enumerate(seqs):
        slots = tables[seq, torch.arange(n) // 4].long() * 4 + torch.arange(n) % 4
        k, v = (c.flatten(0, 1)[slots].transpose(0, 1) for c in (key, value))  # [kv heads, n, d]
        q = query[start : start + n].transpose(0, 1)
        pos = torch.arange(n)
        mask = pos[None, :] <= pos[:, None]
        if window is not None:
            mask &= pos[None, :] > pos[:, None] - window
        if window is None:
            sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        torch.testing.assert_close(out[start : start + n], sdpa.transpose(0, 1), rtol=1e-5, atol=1e-5)
        start += n


# Gemma 2's soft-capped scores and Phi-3-mini's head_dim of 96 (padded to 128 columns, masked): small caps bite on
# these random problems (scores of a few units)
FAMILY_CASES = [(24, None), (32, 2.0), (24, 2.0)]  # (head_dim, softcap)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("head_dim,softcap", FAMILY_CASES)
def test_decode_softcap_and_unpadded_head_dim(attention, device, head_dim, softcap, window):
    args = decode_problem(DECODE_CONTEXTS, 8, 2, head_dim, 4, window, torch.float32, device)
    expected = attention.paged_decode_attention_torch(*args, window=window, softcap=softcap)
    if softcap is not None:
        assert (expected - attention.paged_decode_attention_torch(*args, window=window)).abs().max() > 1e-2
    for num_splits in (None, 1):
        check(attention.paged_decode_attention(*args, window=window, num_splits=num_splits, softcap=softcap), expected)
    if head_dim == 24:  # the CUDA-core score path (MHA) masks the padded columns too
        mha = decode_problem(DECODE_CONTEXTS, 2, 2, head_dim, 4, window, torch.float32, device)
        out = attention.launch_decode(*mha, window, None, 2, attention.AttentionTiles(is_dot=False), softcap)
        check(out, attention.paged_decode_attention_torch(*mha, window=window, softcap=softcap))


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("head_dim,softcap", FAMILY_CASES)
def test_prefill_softcap_and_unpadded_head_dim(attention, device, head_dim, softcap, window):
    args = prefill_problem(PREFILL_SEQS, 4, 2, head_dim, 4, window, torch.float32, device)
    check(attention.paged_prefill_attention(*args, window=window, softcap=softcap),
          attention.paged_prefill_attention_torch(*args, window=window, softcap=softcap))


@pytest.mark.parametrize("window", [None, 5])
def test_softcap_reference_is_transformers_eager_attention(attention, window):
    """Gemma 2's attention in transformers (eager: soft-cap, then the causal / sliding mask) on whole sequences."""
    from types import SimpleNamespace

    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    seqs, num_heads, num_kv_heads, head_dim, softcap = [(12, 12), (20, 20)], 4, 2, 16, 3.0
    query, key, value, tables, *lens, scale = prefill_problem(seqs, num_heads, num_kv_heads, head_dim, 4, window,
                                                              torch.float32, "cpu", is_poisoned=False)
    out = attention.paged_prefill_attention_torch(query, key, value, tables, *lens, scale, window=window,
                                                  softcap=softcap)
    module = SimpleNamespace(num_key_value_groups=num_heads // num_kv_heads, training=False, head_dim=head_dim)
    start = 0
    for seq, (n, _) in enumerate(seqs):
        slots = tables[seq, torch.arange(n) // 4].long() * 4 + torch.arange(n) % 4
        k, v = (c.flatten(0, 1)[slots].transpose(0, 1)[None] for c in (key, value))  # [1, kv heads, n, d]
        pos = torch.arange(n)
        visible = pos[None, :] <= pos[:, None]
        if window is not None:
            visible &= pos[None, :] > pos[:, None] - window
        mask = torch.zeros(n, n).masked_fill(~visible, float("-inf"))[None, None]
        expected, _ = eager_attention_forward(module, query[start : start + n].transpose(0, 1)[None], k, v, mask,
                                              scaling=scale, softcap=softcap)
        torch.testing.assert_close(out[start : start + n], expected[0], rtol=1e-5, atol=1e-5)
        start += n


GPU_DTYPES = [torch.bfloat16, torch.float16]
# (heads, kv heads, head_dim): Llama-2-7B, Llama-3-8B, small GQA, Gemma's 256, Phi-3-mini's 96
GPU_HEADS = [(32, 32, 128), (32, 8, 128), (16, 2, 64), (8, 8, 256), (32, 32, 96)]


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 1000])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", GPU_HEADS)
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_gpu_decode(attention, dtype, num_heads, num_kv_heads, head_dim, window):
    gen = torch.Generator().manual_seed(3)
    contexts = [1, 16, 17, 4096] + torch.randint(1, 4097, (60,), generator=gen).tolist()
    args = decode_problem(contexts, num_heads, num_kv_heads, head_dim, 16, window, dtype, "cuda", num_padded=4)
    expected = attention.paged_decode_attention_torch(*args, window=window)
    for num_splits in (None, 1, 7, 64):
        check(attention.paged_decode_attention(*args, window=window, num_splits=num_splits), expected)
    if num_heads == num_kv_heads:  # MHA has both score paths
        out = attention.launch_decode(*args, window, None, None, attention.AttentionTiles(is_dot=False))
        check(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", GPU_HEADS)
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_gpu_prefill(attention, dtype, num_heads, num_kv_heads, head_dim, window):
    seqs = [(1024, 1024), (512, 1536), (1, 700), (300, 300), (1, 1), (129, 2000), (64, 64), (1, 4096)]
    args = prefill_problem(seqs, num_heads, num_kv_heads, head_dim, 16, window, dtype, "cuda")
    check(attention.paged_prefill_attention(*args, window=window),
          attention.paged_prefill_attention_torch(*args, window=window))


@pytest.mark.gpu
@pytest.mark.parametrize("softcap", [50.0, 1.0])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(16, 8, 256), (32, 32, 96)])
def test_gpu_softcap(attention, num_heads, num_kv_heads, head_dim, softcap):
    """Gemma 2's shapes with its cap (50) and one that bites; a sliding window of 4096 over longer contexts."""
    contexts = [1, 17, 4100, 9000, 5000]
    args = decode_problem(contexts, num_heads, num_kv_heads, head_dim, 16, 4096, torch.bfloat16, "cuda")
    check(attention.paged_decode_attention(*args, window=4096, softcap=softcap),
          attention.paged_decode_attention_torch(*args, window=4096, softcap=softcap))
    seqs = [(1024, 1024), (512, 5000), (1, 700)]
    args = prefill_problem(seqs, num_heads, num_kv_heads, head_dim, 16, 4096, torch.bfloat16, "cuda")
    check(attention.paged_prefill_attention(*args, window=4096, softcap=softcap),
          attention.paged_prefill_attention_torch(*args, window=4096, softcap=softcap))


@pytest.mark.gpu
@pytest.mark.parametrize("window,num_splits", [(None, None), (None, 8), (700, 32)])
def test_gpu_decode_graph_replays_new_lengths_and_tables(attention, window, num_splits):
    """A captured decode replays with context_lens, block_tables and query rewritten in place between replays."""
    num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks = 48, 32, 8, 128, 16, 128
    num_blocks = num_seqs * max_blocks + 1  # block 0: the padded rows' null block
    dtype, scale = torch.bfloat16, 1 / math.sqrt(head_dim)
    key = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device="cuda", dtype=dtype)
    value = torch.randn_like(key)
    query = torch.empty(num_seqs, num_heads, head_dim, device="cuda", dtype=dtype)
    tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int32, device="cuda")
    lens = torch.ones(num_seqs, dtype=torch.int32, device="cuda")
    out = torch.empty_like(query)

    def refill(seed: int) -> None:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        query.copy_(torch.randn(query.shape, generator=gen, device="cuda", dtype=dtype))
        lens.copy_(torch.randint(1, max_blocks * block_size + 1, (num_seqs,), generator=gen, device="cuda"))
        perm = 1 + torch.randperm(num_blocks - 1, generator=gen, device="cuda")
        tables.copy_(perm.view(num_seqs, max_blocks))
        lens[-5:], tables[-5:] = 1, 0  # padded rows
        lens[0] = max_blocks * block_size

    def call() -> None:
        attention.paged_decode_attention(query, key, value, tables, lens, scale, window, out, num_splits)

    refill(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # compiles before the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for seed in (1, 2, 3):
        refill(seed)
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        check(out, attention.paged_decode_attention_torch(query, key, value, tables, lens, scale, window))
