"""Static decode inputs: every per-step tensor of a decode step in one device buffer, filled by one copy.

A decode step (one new token per sequence) of up to `max_seqs` sequences reads its inputs from fixed device
addresses, so a CUDA graph captured over them replays with new values. One int64 host buffer (pinned on CUDA)
holds every input; `fill` writes a step into it and copies it to the device buffer in one transfer. Regions:

    token_ids, positions, slot_mapping, context_lens: [max_seqs]
    lora token_slots, sorted_tokens: [max_seqs]; tiles: [max_tiles, TILE_HEAD + 16]
    per projection kind: row_start, rank [max_slots + 1, num_slices], scale float32 (two to an int64)
    per staged kind (engine/adapters/staging.py): t_col [max_slots + 1, num_slices]
    block_tables: [max_seqs, max_blocks]  (last: a bucket of B rows copies only what it reads)

A bucket of B sequences reads the first B rows of each region. Rows past the batch are padding: token 0 at
position 0, written to the pad slot (a KV block no sequence owns), context 1, no adapter. Tiles past the
step's are empty (no tokens) and point at the last slot, which has rank 0 everywhere, so the LoRA kernels'
programs for them move no bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kubelora.engine.model.attention import DecodeMetadata
from kubelora.engine.model.llama import ForwardContext
from kubelora.engine.step.layout import StaticInputs, table_regions
from kubelora.engine.step.shape import (TILE_M, LoRAShape, Phase, StepShape, decode_buckets, decode_shape,
                                        max_tiles)
from kubelora.kernels.lora import TILE_HEAD, LoRAOps, LoRAProj, LoRAStep

if TYPE_CHECKING:
    from kubelora.engine.adapters.staging import StagedStep

@dataclass(frozen=True)
class DecodeStep:
    """One decode step, as the runner hands it over: per sequence, in batch order."""

    phase = Phase.DECODE

    token_ids: list[int]
    positions: list[int]
    block_tables: list[tuple[int, ...]]
    token_slots: list[int]  # -1: base model
    slot_tables: dict[str, tuple[list, list, list]]  # kind -> (row_start, rank, scale) per slot and slice
    staged: StagedStep | None = None  # the staged shrinks' rows and columns (None: none, or past the capacity)

    @property
    def num_logits(self) -> int:
        return len(self.token_ids)

    def shape(self, bucket: int) -> StepShape:
        return decode_shape(bucket, self.token_slots, self.slot_tables,
                            self.staged.rows if self.staged is not None else None)


class DecodeInputs(StaticInputs):
    phase = Phase.DECODE
    # A decode step's LoRA shapes are many (tile rows, staged rows) and each replays for many steps: a missing
    # graph is captured on the step's first use rather than run eagerly.
    is_captured_on_first_use = True

    def __init__(self, max_seqs: int, max_blocks: int, block_size: int, pad_block: int,
                 kind_slices: dict[str, int], device: torch.device, staged_kinds: tuple[str, ...] = ()) -> None:
        self.max_seqs = max_seqs
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.pad_slot = pad_block * block_size
        self.max_slots = max_seqs  # a step has at most one adapter per sequence
        self.num_tiles = max_tiles(max_seqs, self.max_slots)
        self.kind_slices = dict(kind_slices)
        self.staged_kinds = tuple(staged_kinds)
        self.buckets = decode_buckets(max_seqs)
        super().__init__(self._layout(), device)

    def _layout(self) -> list[tuple[str, int]]:
        n, table_rows = self.max_seqs, self.max_slots + 1
        regions = [("token_ids", n), ("positions", n), ("slot_mapping", n), ("context_lens", n),
                   ("token_slots", n), ("sorted_tokens", n), ("tiles", self.num_tiles * (TILE_HEAD + TILE_M))]
        regions += table_regions(self.kind_slices, table_rows)
        regions += [(f"{kind}.t_col", table_rows * self.kind_slices[kind]) for kind in self.staged_kinds]
        return regions + [("block_tables", n * self.max_blocks)]

    # ---- device views a graph captures (bucket = the padded batch size) ----

    def token_ids(self, bucket: int) -> torch.Tensor:
        return self._region(self.device_buf, "token_ids", bucket)

    def positions(self, bucket: int) -> torch.Tensor:
        return self._region(self.device_buf, "positions", bucket)

    def slot_mapping(self, bucket: int) -> torch.Tensor:
        return self._region(self.device_buf, "slot_mapping", bucket)

    def context_lens(self, bucket: int) -> torch.Tensor:
        return self._region(self.device_buf, "context_lens", bucket)

    def block_tables(self, bucket: int) -> torch.Tensor:
        return self._region(self.device_buf, "block_tables", bucket * self.max_blocks).view(bucket, self.max_blocks)

    def context(self, shape: StepShape, lora_ops: LoRAOps) -> ForwardContext:
        bucket = shape.bucket
        attention = DecodeMetadata(slot_mapping=self.slot_mapping(bucket), block_tables=self.block_tables(bucket),
                                   context_lens=self.context_lens(bucket))
        return ForwardContext(attention=attention, positions=self.positions(bucket),
                              lora=self.lora_context(shape, lora_ops))

    def logits_rows(self) -> None:
        """Every row's logits (padding rows' too: sampling reads the step's first rows only)."""
        return None

    def lora_step(self, bucket: int, key: LoRAShape) -> LoRAStep:
        """The graph's LoRAStep: fixed tile count for the bucket, every size from shapes (see module doc)."""
        return self._lora_step(bucket, max_tiles(bucket, self.max_slots), self.max_slots + 1, key.rows)

    def lora_projs(self, key: LoRAShape) -> dict[str, LoRAProj]:
        table_rows = self.max_slots + 1
        t_cols = {kind: self._region(self.device_buf, f"{kind}.t_col", table_rows * self.kind_slices[kind])
                  .view(table_rows, self.kind_slices[kind]) for kind, rows in key.stage if rows}
        return self._slot_projs(self.kind_slices, table_rows, key.kinds, key.lanes, t_cols)

    # ---- host side, once per step ----

    def fill(self, step: DecodeStep, shape: StepShape) -> None:
        """Write one step into the host buffer (padding rows up to its bucket) and copy it to the device."""
        num, bucket = len(step.token_ids), shape.bucket
        assert 0 < num <= bucket <= self.max_seqs
        self._take_turn()
        pad = bucket - num
        self._put("token_ids", step.token_ids + [0] * pad)
        self._put("positions", step.positions + [0] * pad)
        self._put("context_lens", [p + 1 for p in step.positions] + [1] * pad)
        bs = self.block_size
        slots = [table[p // bs] * bs + p % bs for table, p in zip(step.block_tables, step.positions)]
        self._put("slot_mapping", slots + [self.pad_slot] * pad)
        first = self._offsets["block_tables"]
        tables = self._host[first : first + bucket * self.max_blocks].reshape(bucket, self.max_blocks)
        tables[:] = self.pad_slot // bs
        for row, table in enumerate(step.block_tables):
            tables[row, : len(table)] = table
        if shape.lora is not None:
            self._fill_lora(step, bucket)
        self._copy(first + bucket * self.max_blocks)

    def fill_padding(self) -> None:
        """Every row padding (what graphs are captured over at start-up: their warm-up writes only the pad block)."""
        n = self.max_seqs
        for _ in self._host_bufs:
            self._take_turn()
            for name, value in (("token_ids", 0), ("positions", 0), ("context_lens", 1),
                                ("slot_mapping", self.pad_slot), ("block_tables", self.pad_slot // self.block_size)):
                length = n * self.max_blocks if name == "block_tables" else n
                self._put(name, [value] * length)
            self._put_tiles([], self.max_slots, n, self.num_tiles)  # every tile empty, on the rank-0 pad slot
            self._clear_slot_tables(self.kind_slices, self.max_slots + 1)
            for kind in self.staged_kinds:
                self._put(f"{kind}.t_col", [0] * ((self.max_slots + 1) * self.kind_slices[kind]))
        self.device_buf.copy_(self.host_buf)

    def _fill_lora(self, step: DecodeStep, bucket: int) -> None:
        self._put_tiles(step.token_slots, self.max_slots, bucket, max_tiles(bucket, self.max_slots))
        table_rows = self.max_slots + 1
        self._put_slot_tables(step.slot_tables, self.kind_slices, table_rows)
        if step.staged is not None:
            for kind, t_col in step.staged.t_col.items():
                blank = (table_rows - len(t_col)) * self.kind_slices[kind]
                self._put(f"{kind}.t_col", [v for r in t_col for v in r] + [0] * blank)

