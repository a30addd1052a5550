"""Decode at long contexts (`--scenarios long-context`, `--preset long-context`; docs/benchmarks-engine.md).

For each context of `long_contexts`, one engine sized for it: long_batch requests of `context` random prompt
tokens decode output_len tokens each, without adapters and then round robin over long_adapters distinct
rank-`rank` adapters. The row's warm-up pass prefills the prompts and the prefix cache keeps their KV, so the timed
repeats prefill only each prompt's last block (the cache never serves a prompt's last token) and time decode steps
at that context. The bytes floor of a
row counts the weights, each sequence's KV read per step (averaged over the decode's contexts) and the adapters'
bytes, over the measured copy rate.
"""

from __future__ import annotations

import math

from kubelora.bench.engine_assets import AdapterSpec
from kubelora.bench.engine_device import Floor, decode_floor, kv_bytes
from kubelora.bench.engine_offline import Workload, random_prompts, round_robin
from kubelora.bench.engine_plan import EngineBenchConfig

KV_BLOCK_TOKENS = 16  # the engines' kv_block_size, set with their block count
SPARE_BLOCKS_PER_SEQUENCE = 2  # slack over a sequence's exact block count at max_model_len (16 x 2 x 2 MiB at 8B)
KEY_PREFIX = "long-"  # of every long-context row's key


def row_key(context: int, num_adapters: int) -> str:
    return f"{KEY_PREFIX}{context}-a{num_adapters}"


def row_label(config: EngineBenchConfig, context: int, num_adapters: int) -> str:
    adapters = f"{num_adapters} adapters r{config.rank}" if num_adapters else "base"
    return f"batch {config.long_batch} at {context} tokens of context, {adapters}"


def adapter_counts(config: EngineBenchConfig) -> tuple[int, int]:
    """Distinct adapters of the two rows at each context: none (base), long_adapters."""
    return 0, config.long_adapters


def engine_options(config: EngineBenchConfig, context: int) -> dict:
    """The engine of one context: max_model_len for its prompts and their decode, and KV blocks for the whole
    batch at that length. The block count is set, not derived from free memory, so a device without room for the
    batch fails at start-up instead of decoding it in waves."""
    max_model_len = KV_BLOCK_TOKENS * math.ceil((context + config.output_len) / KV_BLOCK_TOKENS)
    return {"max_model_len": max_model_len, "max_num_seqs": config.long_batch, "kv_block_size": KV_BLOCK_TOKENS,
            "num_kv_blocks": config.long_batch * (max_model_len // KV_BLOCK_TOKENS + SPARE_BLOCKS_PER_SEQUENCE),
            "max_loras": config.long_adapters, "max_lora_rank": config.rank, "max_cpu_loras": config.long_adapters}


def workload(config: EngineBenchConfig, vocab_size: int, context: int, names: list[str]) -> Workload:
    """long_batch prompts of `context` tokens (the same for every row of that context), adapters round robin."""
    prompts = random_prompts(config.long_batch, context, vocab_size, config.seed + 2)
    return Workload(prompts, round_robin(names, config.long_batch), config.output_len)


def floors(result) -> dict[tuple[int, int], Floor]:
    """(context, distinct adapters) -> bytes floor, for every long-context row measured."""
    c, shape = result.config, result.shape
    if shape is None or not result.copy_bytes_per_s:
        return {}
    adapter = AdapterSpec("r", c.rank).num_bytes(shape)
    return {(context, n): decode_floor(shape, c.long_batch, context, c.output_len, n * adapter, n,
                                       result.copy_bytes_per_s)
            for context in c.long_contexts for n in adapter_counts(c) if row_key(context, n) in result.rows}


def table(result) -> list[str]:
    """One line per long-context row: its median decode step against its bytes floor."""
    c, found = result.config, floors(result)
    if not found:
        return []
    lines = ["| context tokens | distinct adapters | batch | ms/step | ms/step spread | bytes per step GB (of which "
             "KV) | floor ms/step | share of the floor | notes |", "|---|---|---|---|---|---|---|---|---|"]
    for (context, n), floor in found.items():
        row = result.rows[row_key(context, n)]
        ms, spread = row.median("decode_ms"), row.spread("decode_ms")
        kv = kv_bytes(result.shape, c.long_batch, context, c.output_len)
        seen = min(r.max_batch for r in row.runs)
        note = "" if seen >= c.long_batch else f"not one batch: at most {seen} sequences in a step"
        lines.append(f"| {context} | {n} | {c.long_batch} | {'-' if ms is None else f'{ms:.2f}'} | "
                     f"{'-' if spread is None else f'{spread[0]:.2f}..{spread[1]:.2f}'} | "
                     f"{floor.step_bytes / 1e9:.2f} ({kv / 1e9:.2f}) | {floor.ms:.2f} | "
                     f"{'-' if not ms else f'{floor.ms / ms:.0%}'} | {note} |")
    return lines
