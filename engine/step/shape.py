"""Step shapes: the one place a static step's sizes are rounded, to pick its graph and to plan graphs ahead.

A static step (decode: one token per sequence; prefill: one sequence's chunk) runs from a graph captured for its
`StepShape`: the phase, the padded size (a batch bucket for decode, a token bucket for prefill) and, when some
token has an adapter, its `LoRAShape` (projection kinds adapted, rank lanes, tile rows, staged rows). The keys of
running steps (`decode_shape`, `prefill_shape`) and the shapes planned ahead for the registered adapters
(`plan_decode_shapes`, `plan_prefill_shapes`) are built by the same `lora_shape`, so a graph captured ahead is the
graph a step of that shape looks up.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

TILE_M = 16  # LoRA tile height of static steps (the kernels' decode launch shape; tl.dot needs 16 rows)
RANK_LANE = 16  # rank lanes are a multiple of this
MAX_PREFILL_BUCKET = 512  # longer chunks are compute-bound, their launches a small share
MIN_STAGE_BUCKET = 64

# kind -> (row_start, rank, scale, b_row_start, dora_row + 1) per slot and slice (engine/adapters/pool.py: slot_tables)
Tables = Mapping[str, tuple[list, ...]]


class Phase(enum.Enum):
    DECODE = "decode"
    PREFILL = "prefill"


@dataclass(frozen=True)
class LoRAShape:
    """What a LoRA graph is specialised on besides its bucket."""

    kinds: tuple[str, ...]  # projection kinds some adapter of the step adapts
    lanes: int  # the step's max rank rounded up to RANK_LANE
    rows: int  # most tokens of one adapter in a tile, rounded up to a power of two (<= TILE_M)
    # (kind, staged rows the kind's matmul reads) for the kinds whose shrink is staged (engine/adapters/staging.py)
    stage: tuple[tuple[str, int], ...] = ()
    dora: tuple[str, ...] = ()  # kinds some DoRA adapter of the step adapts (their outputs scaled per token)


@dataclass(frozen=True)
class StepShape:
    phase: Phase
    bucket: int  # decode: padded batch size; prefill: padded token count
    lora: LoRAShape | None  # None: no token of the step has an adapter (the base graph)


# ---- rounding ----

def decode_buckets(max_num_seqs: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, then multiples of 16 up to max_num_seqs (which is always one)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


def prefill_buckets(max_num_batched_tokens: int) -> list[int]:
    """16, 32, 64, then steps of 1.5x and 2x in turn (96, 128, 192, 256, 384, 512: padding at most a third of a
    bucket, whose compute a short prefill's weight reads mostly hide), up to the first that holds a step's whole
    token budget, at most MAX_PREFILL_BUCKET. Every bucket is whole LoRA tiles."""
    sizes = [16, 32, 64] + [size for power in (64, 128, 256) for size in (power * 3 // 2, power * 2)]
    top = next((size for size in sizes if size >= min(max_num_batched_tokens, MAX_PREFILL_BUCKET)), sizes[-1])
    return [size for size in sizes if size <= top]


def bucket_for(buckets: list[int], size: int) -> int | None:
    """The smallest bucket that holds `size`; None past the largest."""
    return next((b for b in buckets if b >= size), None)


def rank_lanes(rank: int) -> int:
    return -(-rank // RANK_LANE) * RANK_LANE


def tile_rows(num_tokens: int) -> int:
    """Rows a tile of an adapter with num_tokens tokens in the step reads: a power of two, at most TILE_M."""
    return 1 << (min(num_tokens, TILE_M) - 1).bit_length()


def stage_bucket(rows: int, capacity: int) -> int:
    """Rows the matmul reads for a step whose staged rows end at `rows`: the smallest of 64, 96, 128, 192, 256,
    ... (x1.5 steps at most) that holds them, at most the capacity; 0 for none."""
    if rows <= 0:
        return 0
    size = MIN_STAGE_BUCKET
    while size < rows:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return min(size, capacity)


def max_tiles(num_tokens: int, num_slots: int) -> int:
    """Tiles of TILE_M a static step of num_tokens tokens over at most num_slots adapters can need."""
    return min(num_tokens, num_slots + num_tokens // TILE_M)


def lora_shape(kinds: tuple[str, ...], max_rank: int, max_tokens: int,
               stage: Iterable[tuple[str, int]] = (), dora: tuple[str, ...] = ()) -> LoRAShape | None:
    """The LoRA shape of a step whose adapters adapt `kinds` at ranks up to max_rank, with at most max_tokens
    tokens of one adapter; stage: (kind, staged rows, already a `stage_bucket`) of its staged kinds. None: no
    kind adapted."""
    if not kinds or max_rank <= 0:
        return None
    by_kind = dict(stage)
    staged = tuple((kind, by_kind[kind]) for kind in kinds if by_kind.get(kind))
    return LoRAShape(kinds=tuple(kinds), lanes=rank_lanes(max_rank), rows=tile_rows(max_tokens), stage=staged,
                     dora=tuple(dora))


# ---- the shape of a step ----

def table_kinds(tables: Tables) -> tuple[tuple[str, ...], int]:
    """(kinds some slot adapts, their max rank) of a step's slot tables."""
    ranks = {kind: max((r for row in table[1] for r in row), default=0) for kind, table in tables.items()}
    return tuple(kind for kind, rank in ranks.items() if rank > 0), max(ranks.values(), default=0)


def dora_kinds(tables: Tables) -> tuple[str, ...]:
    """The kinds some slot of a step adapts with DoRA."""
    return tuple(kind for kind, table in tables.items() if len(table) > 4 and any(v for row in table[4] for v in row))


def decode_shape(bucket: int, token_slots: list[int], tables: Tables,
                 staged_rows: Mapping[str, int] | None = None) -> StepShape:
    """A decode step's shape: token_slots, one per sequence (-1: base); staged_rows: kind -> staged rows."""
    counts: dict[int, int] = {}
    for slot in token_slots:
        if slot >= 0:
            counts[slot] = counts.get(slot, 0) + 1
    lora = None
    if counts:
        kinds, max_rank = table_kinds(tables)
        lora = lora_shape(kinds, max_rank, max(counts.values()), (staged_rows or {}).items(), dora_kinds(tables))
    return StepShape(Phase.DECODE, bucket, lora)


def prefill_shape(bucket: int, tables: Tables | None) -> StepShape:
    """A one-sequence chunk's shape: tables of its one slot (None: base). Every tile of a chunk may be full."""
    lora = lora_shape(*table_kinds(tables), TILE_M, dora=dora_kinds(tables)) if tables is not None else None
    return StepShape(Phase.PREFILL, bucket, lora)


# ---- shapes planned ahead ----

def plan_decode_shapes(buckets: list[int], kinds: tuple[str, ...], max_rank: int, num_adapters: int | None = None,
                       staging=None, staged_rows: Mapping[str, int] | None = None,
                       dora: tuple[str, ...] = ()) -> list[StepShape]:
    """The decode shapes steps over adapters of one shape use most (num_adapters registered): per bucket, one token
    per adapter, two, and as many as a tile holds; with staging (ShrinkStaging: modules and capacity per kind), the
    rows a step over that many such adapters stages (staged_rows: kind -> one adapter's rows; its lanes on every
    module of the kind where not given)."""
    shapes = []
    for bucket in buckets:
        for tokens in sorted({1, min(2, tile_rows(bucket)), tile_rows(bucket)}):
            adapters = -(-bucket // tokens)  # at least this many adapters fill the bucket at `tokens` each
            if num_adapters is not None:
                adapters = min(adapters, num_adapters)
            stage = _planned_stage(kinds, rank_lanes(max_rank), adapters, staging, staged_rows or {})
            shapes.append(StepShape(Phase.DECODE, bucket, lora_shape(kinds, max_rank, tokens, stage, dora)))
    return shapes


def _planned_stage(kinds: tuple[str, ...], lanes: int, num_adapters: int, staging,
                   staged_rows: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    """Staged rows of a step over num_adapters adapters each staging staged_rows[kind] rows of a kind."""
    if staging is None:
        return ()
    stage = []
    for kind in kinds:
        if kind in staging.modules:
            rows = num_adapters * staged_rows.get(kind, lanes * len(staging.modules[kind]))
            if rows > staging.capacity[kind]:
                return ()  # such a step runs its shrink launches (ShrinkStaging.stage: None)
            stage.append((kind, stage_bucket(rows, staging.capacity[kind])))
    return tuple(stage)


def plan_prefill_shapes(buckets: list[int], kinds: tuple[str, ...], max_rank: int,
                        dora: tuple[str, ...] = ()) -> list[StepShape]:
    """The prefill shapes chunks over an adapter of one kind set and rank use: one per bucket."""
    return [StepShape(Phase.PREFILL, bucket, lora_shape(kinds, max_rank, TILE_M, dora=dora)) for bucket in buckets]
