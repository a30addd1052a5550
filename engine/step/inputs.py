"""Step inputs: every per-step tensor of a forward pass in one device buffer, filled by one copy a step.

Every step, replayed from a CUDA graph or run eagerly, reads its inputs from named regions of one int64 device
buffer: a graph captured over those fixed addresses replays with new values, and an eager step reads the same
regions at its own sizes, so the CPU (where no graph is captured) runs what CUDA replays. The host side is one
int64 buffer (pinned on CUDA) per turn, two turns: a step is filled while the previous step's copy may still be
queued. Regions, for at most T tokens and S sequences:

    token_ids, positions, slot_mapping, token_slots, sorted_tokens, logits_rows: [T]
    query_start_loc [S + 1], seq_lens [S], context_lens [S]
    tiles: the LoRA tile table (kernels/lora.py: tile_table)
    per table kind (each projection kind, embed, lm_head): row_start, rank, b_row_start, dora [(S + 1) x slices],
    scale float32 (two to an int64)
    per staged kind (engine/adapters/staging.py): t_col [(S + 1) x slices]
    block_tables: [S, max_blocks]   (last: a step copies only the rows it reads)

A step is read at an `Extent`: its own sizes (an eager step), or the bucket of its `StepShape` (a static step:
engine/step/shape.py). Rows past a step's are padding: token 0 at position 0, written to the pad slot (a KV block
no sequence owns); a decode bucket's padding rows are sequences of one token with a context of one, a prefill
bucket's belong to no sequence (the attention kernels leave them zero) and no logits row reads them. Tiles past a
static step's are empty and on the slot after the step's, whose slot table row is rank 0 everywhere, so the LoRA
kernels' programs for them move no bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from kubelora.engine.model.attention import AttentionMetadata
from kubelora.engine.model.llama import ForwardContext, LoRAContext
from kubelora.engine.step.shape import TILE_M, Phase, StepShape, Tables, dora_kinds, max_tiles
from kubelora.kernels.lora import (MAX_TILES, TILE_HEAD, TILE_HEIGHTS, LoRAOps, LoRAProj, LoRAStep, TilePlan,
                                   plan_tiles, sort_by_slot, tile_table)

if TYPE_CHECKING:
    from kubelora.engine.adapters.staging import StagedStep


@dataclass(frozen=True)
class Step:
    """One step as the runner hands it over: its sequences' new tokens, sequence after sequence."""

    token_ids: np.ndarray  # [num_tokens] int64 (a token the previous step sampled: 0 here, patched on the device)
    query_lens: list[int]  # new tokens per sequence
    start_pos: list[int]  # each sequence's first new position (what is cached before it)
    block_tables: list[Sequence[int]]
    seq_slots: list[int]  # each sequence's slot in slot_tables; -1: base model
    slot_tables: Tables  # kind -> (row_start, rank, scale) per slot and slice; empty: no adapter
    logits_rows: list[int]  # batch rows whose logits are computed, ascending
    staged: StagedStep | None = None  # a decode step's staged shrinks (None: none, or past the capacity)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.size)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_logits(self) -> int:
        return len(self.logits_rows)

    @property
    def is_decode(self) -> bool:
        """One new token per sequence and every row's logits."""
        return self.num_tokens == self.num_seqs == self.num_logits

    def token_slots(self) -> np.ndarray:
        return np.repeat(np.asarray(self.seq_slots, dtype=np.int64), self.query_lens)


@dataclass(frozen=True, eq=False)
class LoRAExtent:
    """The LoRA sizes a step is read at."""

    tiles: int  # tile table rows
    block_m: int  # tile height
    is_slot_tiles: bool  # tile i is slot i
    table_rows: int  # slot table rows the kernels index (a static step's: one past its slots, rank 0)
    max_tile_count: int  # the most tokens a tile holds
    num_lora_tokens: int  # sorted_tokens read
    max_rank: dict[str, tuple[int, ...]]  # per kind and slice: the shrink's lanes (0: no launch)
    stage: dict[str, int] = field(default_factory=dict)  # staged kind -> rows its matmul reads past the base
    dora: tuple[str, ...] = ()  # kinds some DoRA adapter of the step adapts
    plan: TilePlan | None = None  # an eager step's tiles, as planned on the host


@dataclass(frozen=True, eq=False)
class Extent:
    """The sizes a step's inputs are read at: a static step's bucket, or an eager step's own."""

    tokens: int
    seqs: int
    max_query_len: int
    is_padded: bool  # tokens past the sequences' (a prefill bucket's padding)
    logits: int | None  # logits_rows read; None: every row's (a decode step's)
    lora: LoRAExtent | None


_INT_TABLES = ("row_start", "rank", "b_row_start", "dora")  # a slot table's int64 columns, in Tables' order


def table_regions(kind_slices: dict[str, int], table_rows: int) -> list[tuple[str, int]]:
    """The regions of each kind's slot tables: row_start, rank, b_row_start, dora and scale (float32, two to an
    int64)."""
    regions = []
    for kind, slices in kind_slices.items():
        cells = table_rows * slices
        regions += [(f"{kind}.{name}", cells) for name in _INT_TABLES] + [(f"{kind}.scale", (cells + 1) // 2)]
    return regions


def tile_cells(max_tokens: int, max_slots: int) -> int:
    """Cells the tile table can need: a slot's tile each (slot tiles) plus one per full tile, at the tallest
    height's width among those an eager step picks."""
    heights = sorted({TILE_M, *TILE_HEIGHTS})
    return max(min(max_tokens + max_slots, max_slots + max_tokens // h) * (TILE_HEAD + h) for h in heights)


class StepInputs:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, block_size: int, pad_block: int,
                 kind_slices: dict[str, int], device: torch.device, staged_kinds: tuple[str, ...] = ()) -> None:
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.pad_block = pad_block
        self.pad_slot = pad_block * block_size
        self.max_slots = max_seqs  # a step has at most one adapter per sequence
        self.kind_slices = dict(kind_slices)
        self.staged_kinds = tuple(staged_kinds)
        t, s, rows = max_tokens, max_seqs, max_seqs + 1
        layout = [("token_ids", t), ("positions", t), ("slot_mapping", t), ("token_slots", t), ("sorted_tokens", t),
                  ("logits_rows", t), ("query_start_loc", s + 1), ("seq_lens", s), ("context_lens", s),
                  ("tiles", tile_cells(t, self.max_slots)), *table_regions(self.kind_slices, rows),
                  *[(f"{kind}.t_col", rows * self.kind_slices[kind]) for kind in self.staged_kinds],
                  ("block_tables", s * max_blocks)]
        self._offsets: dict[str, int] = {}
        size = 0
        for name, length in layout:
            self._offsets[name] = size
            size += length
        self.size = size
        self.device = device
        self.device_buf = torch.zeros(size, dtype=torch.int64, device=device)
        is_cuda = device.type == "cuda"
        self._host_bufs = [torch.zeros(size, dtype=torch.int64, pin_memory=is_cuda) for _ in range(2)]
        self._copied = [torch.cuda.Event() if is_cuda else None for _ in range(2)]  # each buffer's last copy
        self._turn = 0
        self.host_buf = self._host_bufs[0]
        self._host = self.host_buf.numpy()

    # ---- extents ----

    def static_extent(self, shape: StepShape) -> Extent:
        """A static step's sizes, from its shape only, so that a graph captured at them replays any such step:
        a decode bucket of B sequences of one token, or one sequence's chunk padded to B tokens."""
        bucket, lora = shape.bucket, shape.lora
        is_decode = shape.phase is Phase.DECODE
        lora_extent = None
        if lora is not None:
            table_rows = self.max_slots + 1 if is_decode else 2  # a prefill chunk: its adapter, then rank 0
            tiles = max_tiles(bucket, self.max_slots) if is_decode else bucket // TILE_M
            lora_extent = LoRAExtent(
                tiles=tiles, block_m=TILE_M, is_slot_tiles=False, table_rows=table_rows, max_tile_count=lora.rows,
                num_lora_tokens=bucket, stage=dict(lora.stage), dora=lora.dora,
                max_rank={kind: (lora.lanes if kind in lora.kinds else 0,) * slices
                          for kind, slices in self.kind_slices.items()})
        if is_decode:
            return Extent(bucket, bucket, 1, False, None, lora_extent)
        return Extent(bucket, 1, bucket, True, 1, lora_extent)

    def eager_extent(self, step: Step) -> Extent:
        """An eager step's own sizes; its LoRA tiles planned as kernels/lora.py plans them (tile height, slot
        tiles) and its shrink lanes each slice's highest rank."""
        lora_extent = None
        if any(slot >= 0 for slot in step.seq_slots):
            table_rows = len(next(iter(step.slot_tables.values()))[1])
            plan = plan_tiles(step.token_slots(), table_rows, tile_heights=TILE_HEIGHTS, max_tiles=MAX_TILES)
            max_rank = {kind: tuple(max(column) for column in zip(*table[1]))
                        for kind, table in step.slot_tables.items()}
            lora_extent = LoRAExtent(tiles=plan.tiles.shape[0], block_m=plan.block_m,
                                     is_slot_tiles=plan.is_slot_tiles, table_rows=table_rows,
                                     max_tile_count=plan.max_tile_count, num_lora_tokens=plan.order.size,
                                     max_rank=max_rank, plan=plan, dora=dora_kinds(step.slot_tables))
        return Extent(step.num_tokens, step.num_seqs, max(step.query_lens), False, step.num_logits, lora_extent)

    # ---- device views (what a graph captures) ----

    def _view(self, name: str, length: int) -> torch.Tensor:
        first = self._offsets[name]
        return self.device_buf[first : first + length]

    def token_ids(self, extent: Extent) -> torch.Tensor:
        return self._view("token_ids", extent.tokens)

    def logits_rows(self, extent: Extent) -> torch.Tensor | None:
        """The rows whose logits are computed; None: every row (padding rows' too: sampling reads the first)."""
        return None if extent.logits is None else self._view("logits_rows", extent.logits)

    def context(self, extent: Extent, ops: LoRAOps) -> ForwardContext:
        tokens, seqs = extent.tokens, extent.seqs
        attention = AttentionMetadata(
            slot_mapping=self._view("slot_mapping", tokens),
            block_tables=self._view("block_tables", seqs * self.max_blocks).view(seqs, self.max_blocks),
            query_start_loc=self._view("query_start_loc", seqs + 1), seq_lens=self._view("seq_lens", seqs),
            context_lens=self._view("context_lens", seqs), max_query_len=extent.max_query_len,
            is_padded=extent.is_padded)
        return ForwardContext(attention=attention, positions=self._view("positions", tokens),
                              lora=self._lora_context(extent, ops))

    def _lora_context(self, extent: Extent, ops: LoRAOps) -> LoRAContext | None:
        lora = extent.lora
        if lora is None:
            return None
        tiles = self._view("tiles", lora.tiles * (TILE_HEAD + lora.block_m)).view(lora.tiles, TILE_HEAD + lora.block_m)
        step = LoRAStep(token_slots=self._view("token_slots", extent.tokens), num_slots=lora.table_rows,
                        has_lora=True, sorted_tokens=self._view("sorted_tokens", lora.num_lora_tokens), tiles=tiles,
                        block_m=lora.block_m, is_slot_tiles=lora.is_slot_tiles,
                        num_lora_tokens=lora.num_lora_tokens, max_tile_count=lora.max_tile_count)
        rows, projs = lora.table_rows, {}
        for kind, slices in self.kind_slices.items():
            cells = rows * slices
            scale = self._view(f"{kind}.scale", (cells + 1) // 2).view(torch.float32)[:cells]
            t_col = (self._view(f"{kind}.t_col", cells).view(rows, slices) if lora.stage.get(kind) else None)
            dora = self._view(f"{kind}.dora", cells).view(rows, slices) if kind in lora.dora else None
            projs[kind] = LoRAProj(row_start=self._view(f"{kind}.row_start", cells).view(rows, slices),
                                   rank=self._view(f"{kind}.rank", cells).view(rows, slices),
                                   scale=scale.view(rows, slices), max_rank=lora.max_rank[kind], t_col=t_col,
                                   b_row_start=self._view(f"{kind}.b_row_start", cells).view(rows, slices),
                                   dora_row=dora)
        return LoRAContext(step=step, proj=projs, ops=ops, stage={k: v for k, v in lora.stage.items() if v})

    # ---- host side, once per step ----

    def fill(self, step: Step, extent: Extent) -> None:
        """Write one step into the host buffer, padded to its extent, and copy it to the device."""
        num, seqs = step.num_tokens, step.num_seqs
        tokens, padded_seqs = extent.tokens, extent.seqs
        if not (0 < num <= tokens <= self.max_tokens and 0 < seqs <= padded_seqs <= self.max_seqs):
            raise ValueError(f"a step of {num} tokens over {seqs} sequences does not fit {self.max_tokens} tokens "
                             f"over {self.max_seqs} sequences at {tokens} / {padded_seqs}")
        self._take_turn()
        bs, pad_seqs = self.block_size, padded_seqs - seqs
        first = self._offsets["block_tables"]
        tables = self._host[first : first + padded_seqs * self.max_blocks].reshape(padded_seqs, self.max_blocks)
        tables[:] = self.pad_block
        for row, table in enumerate(step.block_tables):
            tables[row, : len(table)] = table
        starts = np.asarray(step.start_pos, dtype=np.int64)
        if num == seqs:  # one token per sequence (decode): no per-token index
            positions = starts
            blocks = tables[np.arange(seqs), positions // bs]
        else:
            query_lens = np.asarray(step.query_lens, dtype=np.int64)
            seq_of = np.repeat(np.arange(seqs), query_lens)
            positions = starts[seq_of] + np.arange(num) - (np.cumsum(query_lens) - query_lens)[seq_of]
            blocks = tables[seq_of, positions // bs]
        pad = tokens - num
        self._put("token_ids", step.token_ids, pad, 0)
        self._put("positions", positions, pad, 0)
        self._put("slot_mapping", blocks * bs + positions % bs, pad, self.pad_slot)
        ends = np.cumsum(step.query_lens)
        self._put("query_start_loc", np.concatenate([[0], ends, num + np.arange(1, pad_seqs + 1)]))
        self._put("seq_lens", step.query_lens, pad_seqs, 1)
        self._put("context_lens", starts + np.asarray(step.query_lens), pad_seqs, 1)
        if extent.logits is not None:  # a static chunk whose logits nothing samples still computes its last row's
            self._put("logits_rows", step.logits_rows, extent.logits - step.num_logits, num - 1)
        if extent.lora is not None:
            self._fill_lora(step, extent)
        self._copy(first + padded_seqs * self.max_blocks)

    def _fill_lora(self, step: Step, extent: Extent) -> None:
        lora, tokens = extent.lora, extent.tokens
        token_slots = step.token_slots()
        plan = lora.plan
        if plan is None:  # a static step: fixed tiles of TILE_M, those past the step's on the rank-0 row
            order, counts = sort_by_slot(token_slots, lora.table_rows - 1)
            tiles = tile_table(counts, order, TILE_M, num_tiles=lora.tiles)
        else:
            order, tiles = plan.order, plan.tiles
        self._put("token_slots", token_slots, tokens - token_slots.size, -1)
        self._put("sorted_tokens", order, lora.num_lora_tokens - order.size, 0)
        self._put("tiles", tiles.reshape(-1))
        self._put_slot_tables(step.slot_tables, lora.table_rows)
        if step.staged is not None:
            for kind, t_col in step.staged.t_col.items():
                self._put(f"{kind}.t_col", [v for row in t_col for v in row],
                          (lora.table_rows - len(t_col)) * self.kind_slices[kind], 0)

    def _put_slot_tables(self, slot_tables: Tables, table_rows: int) -> None:
        """Each kind's tables per slot and slice; rows past the step's slots zero (rank 0)."""
        for kind, slices in self.kind_slices.items():
            row_start, rank, scale, *rest = slot_tables[kind]
            # tables of three columns (tests, benchmarks): B^T at the A rows' numbers, no DoRA
            columns = {"b_row_start": row_start, "dora": [[0] * slices for _ in rank],
                       **dict(zip(_INT_TABLES, (row_start, rank, *rest)))}
            blank = (table_rows - len(rank)) * slices
            for name in _INT_TABLES:
                values = columns[name]
                self._put(f"{kind}.{name}", [v for row in values for v in row], blank, 0)
            scales = np.zeros(2 * ((table_rows * slices + 1) // 2), dtype=np.float32)
            scales[: len(rank) * slices] = [v for row in scale for v in row]
            self._put(f"{kind}.scale", scales.view(np.int64))

    def fill_padding(self) -> None:
        """Every row padding, in both host buffers and on the device (what graphs are captured over: their forward
        writes only the pad block): sequences of one token at position 0 with a context of one, every slot table
        zero (rank 0), so every tile, empty on slot 0, moves no bytes."""
        for _ in self._host_bufs:
            self._take_turn()
            self._host[:] = 0
            self._put("slot_mapping", [], self.max_tokens, self.pad_slot)
            self._put("query_start_loc", np.arange(self.max_seqs + 1))
            self._put("seq_lens", [], self.max_seqs, 1)
            self._put("context_lens", [], self.max_seqs, 1)
            self._put("block_tables", [], self.max_seqs * self.max_blocks, self.pad_block)
        self.device_buf.copy_(self.host_buf)

    # ---- the host buffers ----

    def _put(self, name: str, values, pad: int = 0, pad_value: int = 0) -> None:
        first = self._offsets[name]
        count = len(values)
        self._host[first : first + count] = values
        if pad:
            self._host[first + count : first + count + pad] = pad_value

    def _take_turn(self) -> None:
        """Switch to the other host buffer, once its last copy to the device has run."""
        self._turn ^= 1
        if self._copied[self._turn] is not None:
            self._copied[self._turn].synchronize()
        self.host_buf = self._host_bufs[self._turn]
        self._host = self.host_buf.numpy()

    def _copy(self, end: int) -> None:
        """The host buffer's first `end` values to the device (queued on the current stream)."""
        self.device_buf[:end].copy_(self.host_buf[:end], non_blocking=True)
        if self._copied[self._turn] is not None:
            self._copied[self._turn].record()
