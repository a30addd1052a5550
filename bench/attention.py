"""Paged attention on CUDA: `python3 -P bench/attention.py [--out FILE]`, kubelora on PYTHONPATH (see bench/h200.sh).

Decode at Llama-2-7B shapes (32 heads, 32 kv heads, head_dim 128, KV blocks of 16, shuffled block tables, every
sequence at the row's context) for our Triton kernel, the portable way without a paged kernel (gather each
sequence's context into a padded batch, then one SDPA; the gather's index is built once, not timed) and PyTorch
FlexAttention's paged path (its block-mask
conversion not timed); launch knobs and split counts as variants; prefill of 16 x 1024 tokens against SDPA causal on
contiguous tensors. Times are medians of triton.testing.do_bench (L2 flushed before each call); bandwidth is K+V
bytes read once over the time, against a device-to-device copy (bytes read + written) measured in the same run.
Every row checks its output against ours (max abs difference, bf16).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from kubelora.kernels.attention import (AttentionTiles, decode_tiles, default_num_splits, launch_decode,
                                        paged_decode_attention, paged_prefill_attention)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 32, 128, 16
BATCHES, CONTEXTS = (1, 16, 64, 256), (256, 1024, 4096)
KNOB_SHAPES, SPLIT_SHAPES = ((16, 4096), (64, 1024)), ((1, 4096), (16, 4096), (16, 1024))  # (batch, context)
GQA_KV_HEADS, GQA_SHAPES = 8, ((64, 4096), (256, 1024))  # Llama-3-8B's 32 / 8 heads
PREFILL_SEQS, PREFILL_LEN = 16, 1024
DTYPE = torch.bfloat16
SCALE = 1 / math.sqrt(HEAD_DIM)
DEVICE = "cuda"


def time_us(fn) -> float:
    return do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 2 GiB device-to-device copy."""
    src = torch.empty(1 << 30, dtype=torch.int16, device=DEVICE)
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / (time_us(lambda: dst.copy_(src)) * 1e-6)


class Cache:
    """One cache big enough for the largest shape; each row's sequences own shuffled blocks of it."""

    def __init__(self, num_kv_heads: int) -> None:
        num_blocks = max(BATCHES) * max(CONTEXTS) // BLOCK + 1
        shape = (num_blocks, BLOCK, num_kv_heads, HEAD_DIM)
        self.key = torch.empty(shape, dtype=DTYPE, device=DEVICE).normal_()
        self.value = torch.empty(shape, dtype=DTYPE, device=DEVICE).normal_()

    def tables(self, batch: int, context: int, seed: int = 0) -> torch.Tensor:
        """[batch, context / BLOCK] int32 distinct blocks in random order (block 0 left out)."""
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        used = batch * context // BLOCK
        perm = 1 + torch.randperm(self.key.shape[0] - 1, generator=gen, device=DEVICE)[:used]
        return perm.view(batch, -1).to(torch.int32)


def decode_args(cache: Cache, batch: int, context: int):
    query = torch.randn(batch, HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    return query, cache.key, cache.value, cache.tables(batch, context), lens, SCALE


def kv_bytes(batch: int, context: int, num_kv_heads: int) -> int:
    return 2 * batch * context * num_kv_heads * HEAD_DIM * torch.finfo(DTYPE).bits // 8


def gather_sdpa_call(args):
    query, key, value, tables, lens, scale = args
    context, kv_heads = int(lens[0]), key.shape[2]
    positions = torch.arange(context, device=query.device)
    slots = tables[:, positions // BLOCK].long() * BLOCK + positions % BLOCK  # [batch, context]

    def call():
        keys = key.view(-1, kv_heads, HEAD_DIM)[slots].transpose(1, 2)  # [batch, kv heads, context, head_dim]
        values = value.view(-1, kv_heads, HEAD_DIM)[slots].transpose(1, 2)
        out = F.scaled_dot_product_attention(query[:, :, None], keys, values, scale=scale,
                                             enable_gqa=query.shape[1] != kv_heads)
        return out.view_as(query)

    return call


class Flex:
    """FlexAttention's paged decode over a copy of the cache in its layout ([1, heads, slots, head_dim], pages of
    BLOCK): one PagedAttention for every row, its page table set from ours, so outputs compare with ours."""

    def __init__(self, cache: Cache, budget_s: float) -> None:
        from torch.nn.attention.experimental._paged_attention import PagedAttention
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention, noop_mask

        for name in ("recompile_limit", "cache_size_limit"):  # one compile per batch size
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 64)
        num_blocks = cache.key.shape[0]
        self.key = cache.key.view(1, -1, KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        self.value = cache.value.view(1, -1, KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        self.paged = PagedAttention(num_blocks, BLOCK, max(BATCHES), device=DEVICE)
        self.create_block_mask, self.noop_mask = create_block_mask, noop_mask
        self.flex = torch.compile(flex_attention, dynamic=False)
        self.deadline = time.monotonic() + budget_s

    def call(self, args):
        if time.monotonic() > self.deadline:
            raise TimeoutError("skipped: time budget (--flex-budget)")
        query, _, _, tables, lens, scale = args
        batch, blocks = tables.shape
        self.paged.page_table[:batch].fill_(-1)
        self.paged.page_table[:batch, :blocks] = tables.long()
        self.paged.physical_to_logical[:batch].fill_(-1)
        logical = torch.arange(blocks, device=DEVICE).expand(batch, -1)
        self.paged.physical_to_logical[:batch].scatter_(1, tables.long(), logical)
        logical_mask = self.create_block_mask(self.noop_mask, batch, None, 1, blocks * BLOCK, device=DEVICE,
                                              BLOCK_SIZE=(128, BLOCK))
        batch_idx = torch.arange(batch, device=DEVICE)
        mask = self.paged.convert_logical_block_mask(logical_mask, batch_idx, lens.long())
        q = query[:, :, None]  # [batch, heads, 1, head_dim]
        return lambda: self.flex(q, self.key, self.value, block_mask=mask, scale=scale)[:, :, 0]


def measure(make_call, reference: torch.Tensor | None):
    """(us, max abs difference to reference or nan), or (None, reason)."""
    try:
        fn = make_call()
        out = fn()
        err = (out.float() - reference.float()).abs().max().item() if reference is not None else math.nan
        return time_us(fn), err
    except Exception as exc:  # report, don't stop the run: the other columns are still worth having
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:90] if str(exc) else ''}"


def cell(us, err, nbytes: int, copy_bw: float) -> list[str]:
    """[us, TB/s (% of copy), error] of one timing, or [reason, "", ""]."""
    if us is None:
        return [str(err).replace("|", "/"), "", ""]
    bw = nbytes / (us * 1e-6)
    return [f"{us:.1f}", f"{bw / 1e12:.2f} ({100 * bw / copy_bw:.0f}%)", f"{err:.1e}"]


def row(cells) -> str:
    line = "| " + " | ".join(map(str, cells)) + " |"
    print(line, flush=True)
    return line


def decode_table(cache: Cache, flex: Flex | str, copy_bw: float) -> list[str]:
    lines = [row(["batch", "context", "splits", "ours us", "ours TB/s (% copy)", "gather+SDPA us", "gather+SDPA TB/s",
                  "gather+SDPA err", "flex us", "flex TB/s", "flex err", "ours / gather+SDPA"]), "|" + " --- |" * 12]
    for batch in BATCHES:
        for context in CONTEXTS:
            args = decode_args(cache, batch, context)
            nbytes = kv_bytes(batch, context, KV_HEADS)
            ours = paged_decode_attention(*args)
            block_n = decode_tiles(1, HEAD_DIM, ours.device).block_n
            splits = default_num_splits(batch, KV_HEADS, args[3].shape[1] * BLOCK, block_n, ours.device)
            us = time_us(lambda: paged_decode_attention(*args))
            eng = measure(lambda: gather_sdpa_call(args), ours)
            fl = measure(lambda: flex.call(args), ours) if isinstance(flex, Flex) else (None, "unavailable")
            ratio = f"{us / eng[0]:.2f}" if eng[0] else ""
            lines.append(row([batch, context, splits, *cell(us, 0.0, nbytes, copy_bw)[:2], *cell(*eng, nbytes, copy_bw),
                              *cell(*fl, nbytes, copy_bw), ratio]))
    return lines


DECODE_VARIANTS = {  # MHA only where is_dot is False
    "default": None,
    "dot n64 w4": AttentionTiles(block_n=64, is_dot=True),
    "reduce n32 w4": AttentionTiles(block_n=32, is_dot=False),
    "reduce n128 w8": AttentionTiles(block_n=128, num_warps=8, is_dot=False),
    "dot n128 w8": AttentionTiles(block_n=128, num_warps=8, is_dot=True),
}


def variant_table(cache: Cache, gqa_cache: Cache, copy_bw: float) -> list[str]:
    """Launch knobs on MHA shapes, split counts on others, and GQA shapes (Llama-3-8B: 8 kv heads); the error is
    against the default launch."""
    lines = [row(["heads / kv heads", "batch", "context", "variant", "splits", "us", "TB/s (% copy)", "err"]),
             "|" + " --- |" * 8]

    def add(cache, shapes, variants, splits_list):
        for batch, context in shapes:
            args = decode_args(cache, batch, context)
            num_kv_heads = cache.key.shape[2]
            expected = paged_decode_attention(*args)
            for name, tiles in variants.items():
                for splits in splits_list:
                    timing = measure(lambda: lambda: launch_decode(*args, None, None, splits, tiles), expected)
                    lines.append(row([f"{HEADS} / {num_kv_heads}", batch, context, name, splits or "default",
                                      *cell(*timing, kv_bytes(batch, context, num_kv_heads), copy_bw)]))

    add(cache, KNOB_SHAPES, DECODE_VARIANTS, [None])
    add(cache, SPLIT_SHAPES, {"default": None}, [1, 2, 4, 8, 16, 32])
    add(gqa_cache, GQA_SHAPES, {"default": None, "dot n128 w8": DECODE_VARIANTS["dot n128 w8"]}, [None, 1, 2, 4])
    return lines


def causal_flops(q_len: int, context: int, num_seqs: int) -> float:
    """QK^T and PV multiply-adds over the visible (query, key) pairs of a causal chunk at the end of the context."""
    pairs = q_len * (context - q_len) + q_len * (q_len + 1) // 2
    return 4 * num_seqs * HEADS * HEAD_DIM * pairs


def prefill_table(cache: Cache) -> list[str]:
    """16 x 1024 new tokens (and 16 x 512 new on 1024 positions) against SDPA causal on contiguous [16, h, L, d]."""
    lines = [row(["case", "ours us", "ours TFLOP/s", "SDPA us", "SDPA TFLOP/s", "max abs err"]), "|" + " --- |" * 6]
    num_seqs, length = PREFILL_SEQS, PREFILL_LEN
    q, k, v = (torch.randn(num_seqs, HEADS, length, HEAD_DIM, dtype=DTYPE, device=DEVICE) for _ in range(3))
    tables = cache.tables(num_seqs, length, seed=1)
    slots = (tables.long()[:, :, None] * BLOCK + torch.arange(BLOCK, device=DEVICE)).flatten()
    cache.key.view(-1, KV_HEADS, HEAD_DIM)[slots] = k.transpose(1, 2).reshape(-1, KV_HEADS, HEAD_DIM)
    cache.value.view(-1, KV_HEADS, HEAD_DIM)[slots] = v.transpose(1, 2).reshape(-1, KV_HEADS, HEAD_DIM)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE).transpose(1, 2)  # [S, L, h, d]
    sdpa_us = time_us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE))
    sdpa_cells = [f"{sdpa_us:.0f}", f"{causal_flops(length, length, num_seqs) / sdpa_us / 1e6:.0f}"]
    lens = torch.full((num_seqs,), length, dtype=torch.int32, device=DEVICE)
    for q_len in (length, length // 2):
        query = q[:, :, length - q_len :].transpose(1, 2).reshape(-1, HEADS, HEAD_DIM)
        seq_lens = torch.full((num_seqs,), q_len, dtype=torch.int32, device=DEVICE)
        starts = torch.arange(num_seqs + 1, dtype=torch.int32, device=DEVICE) * q_len
        args = (query, cache.key, cache.value, tables, starts, seq_lens, lens, q_len, SCALE)
        err = (paged_prefill_attention(*args).float() - expected[:, length - q_len :].flatten(0, 1).float()).abs()
        us = time_us(lambda: paged_prefill_attention(*args))
        lines.append(row([f"{num_seqs} x {q_len} new of {length}", f"{us:.0f}",
                          f"{causal_flops(q_len, length, num_seqs) / us / 1e6:.0f}",
                          *(sdpa_cells if q_len == length else ["-", "-"]), f"{err.max().item():.1e}"]))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the markdown report here")
    parser.add_argument("--flex-budget", type=float, default=80.0, help="seconds for FlexAttention rows, compiles "
                        "included (later rows are skipped)")
    parser.add_argument("--no-variants", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/attention.py needs a CUDA device", file=sys.stderr)
        return 2
    started = time.monotonic()
    copy_bw = copy_bandwidth()
    cache = Cache(KV_HEADS)
    try:
        flex: Flex | str = Flex(cache, args.flex_budget)
    except Exception as exc:  # FlexAttention's paged helper is experimental: absent or changed in some versions
        flex = f"unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:90] if str(exc) else ''}"
    report = [f"# Paged attention, {torch.cuda.get_device_name()}", "",
              f"torch {torch.__version__}, triton {triton.__version__}, {time.strftime('%Y-%m-%d')}; "
              f"copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write); heads {HEADS}, kv heads {KV_HEADS}, "
              f"head_dim {HEAD_DIM}, block {BLOCK}, {DTYPE}.", ""]
    if isinstance(flex, str):
        report += [f"FlexAttention paged: {flex}.", ""]
    report += ["## Decode", ""]
    report += decode_table(cache, flex, copy_bw)
    del flex  # its cache copy
    torch.cuda.empty_cache()
    if not args.no_variants:
        report += ["", "## Decode variants", ""] + variant_table(cache, Cache(GQA_KV_HEADS), copy_bw)
    report += ["", "## Prefill", ""] + prefill_table(cache)
    report += ["", f"Total {time.monotonic() - started:.0f} s."]
    text = "\n".join(report) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
