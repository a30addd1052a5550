"""Static inputs of a one-sequence prefill: what a prefill CUDA graph of a token bucket replays over.

A prefill step of one sequence (a new request's prompt, or one chunk of it) of up to `max_tokens` tokens reads its
inputs from these regions of one device buffer (engine/step/layout.py), filled by one copy a step:

    token_ids, positions, slot_mapping, token_slots, sorted_tokens: [max_tokens]
    tiles: [max_tokens / TILE_M, TILE_HEAD + TILE_M]   (the LoRA tiles: the one adapter's tokens, 16 a tile)
    query_start_loc [2], seq_lens [1], context_lens [1], last_row [1]
    per projection kind: row_start, rank [2, num_slices], scale float32   (slot 0: the adapter; 1: rank 0)
    block_table: [max_blocks]

A bucket of B tokens reads the first B of each per-token region and the first B / 16 tiles. Tokens past the
chunk are padding: token 0 at position 0, written to the pad slot (a KV block no sequence owns), no adapter; the
attention kernels stop at seq_lens (padding rows' outputs stay zero), so padding rows never reach the chunk's rows,
and only the chunk's last row (`last_row`) becomes logits. Tiles past the chunk's are empty and point at slot 1,
which has rank 0 everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kubelora.engine.model.attention import PrefillMetadata
from kubelora.engine.model.llama import ForwardContext
from kubelora.engine.step.layout import StaticInputs, table_regions
from kubelora.engine.step.shape import TILE_M, LoRAShape, Phase, StepShape, prefill_buckets, prefill_shape
from kubelora.kernels.lora import TILE_HEAD, LoRAOps, LoRAProj, LoRAStep

TABLE_ROWS = 2  # slot 0: the chunk's adapter; slot 1: rank 0 everywhere (empty tiles)


@dataclass(frozen=True)
class PrefillStep:
    """One sequence's prefill chunk, as the runner hands it over."""

    phase = Phase.PREFILL

    token_ids: list[int]
    start_pos: int  # position of the first token (the context already cached before it)
    block_table: tuple[int, ...]
    slot_tables: dict[str, tuple[list, list, list]] | None  # kind -> (row_start, rank, scale) of one slot; None: base

    num_logits = 1  # the chunk's last token's

    def shape(self, bucket: int) -> StepShape:
        return prefill_shape(bucket, self.slot_tables)


class PrefillInputs(StaticInputs):
    phase = Phase.PREFILL
    is_captured_on_first_use = False  # a chunk without its graph runs on the eager path (engine/step/static.py)

    def __init__(self, max_tokens: int, max_blocks: int, block_size: int, pad_block: int,
                 kind_slices: dict[str, int], device: torch.device) -> None:
        if max_tokens % TILE_M:
            raise ValueError(f"max_tokens must be a multiple of {TILE_M}, got {max_tokens}")
        self.max_tokens = max_tokens
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.pad_slot = pad_block * block_size
        self.kind_slices = dict(kind_slices)
        self.buckets = prefill_buckets(max_tokens)
        n = max_tokens
        layout = [("token_ids", n), ("positions", n), ("slot_mapping", n), ("token_slots", n), ("sorted_tokens", n),
                  ("tiles", n // TILE_M * (TILE_HEAD + TILE_M)), ("query_start_loc", 2), ("seq_lens", 1),
                  ("context_lens", 1), ("last_row", 1)]
        super().__init__(layout + table_regions(self.kind_slices, TABLE_ROWS) + [("block_table", max_blocks)],
                         device)

    # ---- device views a graph captures (bucket = the padded token count) ----

    def token_ids(self, bucket: int) -> torch.Tensor:
        return self._region(self.device_buf, "token_ids", bucket)

    def positions(self, bucket: int) -> torch.Tensor:
        return self._region(self.device_buf, "positions", bucket)

    def logits_rows(self) -> torch.Tensor:
        """[1] int64: the chunk's last row, the one whose logits are computed."""
        return self._region(self.device_buf, "last_row", 1)

    def context(self, shape: StepShape, lora_ops: LoRAOps) -> ForwardContext:
        return ForwardContext(attention=self.attention(shape.bucket), positions=self.positions(shape.bucket),
                              lora=self.lora_context(shape, lora_ops))

    def attention(self, bucket: int) -> PrefillMetadata:
        def view(name: str, length: int) -> torch.Tensor:
            return self._region(self.device_buf, name, length)

        return PrefillMetadata(slot_mapping=view("slot_mapping", bucket),
                               block_tables=view("block_table", self.max_blocks).view(1, self.max_blocks),
                               query_start_loc=view("query_start_loc", 2), seq_lens=view("seq_lens", 1),
                               context_lens=view("context_lens", 1), max_query_len=bucket, is_padded=True)

    def lora_step(self, bucket: int, key: LoRAShape) -> LoRAStep:
        """Fixed tile count for the bucket; every size from shapes (the kernels read each tile's count)."""
        return self._lora_step(bucket, bucket // TILE_M, TABLE_ROWS, key.rows)

    def lora_projs(self, key: LoRAShape) -> dict[str, LoRAProj]:
        return self._slot_projs(self.kind_slices, TABLE_ROWS, key.kinds, key.lanes)

    # ---- host side, once per step ----

    def fill(self, step: PrefillStep, shape: StepShape) -> None:
        """Write one chunk into the host buffer (padding up to its bucket) and copy it to the device."""
        num, bucket = len(step.token_ids), shape.bucket
        assert 0 < num <= bucket <= self.max_tokens and bucket % TILE_M == 0
        self._take_turn()
        pad = bucket - num
        bs, start = self.block_size, step.start_pos
        table = step.block_table
        self._put("token_ids", list(step.token_ids) + [0] * pad)
        self._put("positions", list(range(start, start + num)) + [0] * pad)
        self._put("slot_mapping", [table[p // bs] * bs + p % bs for p in range(start, start + num)]
                  + [self.pad_slot] * pad)
        self._put("query_start_loc", [0, num])
        self._put("seq_lens", [num])
        self._put("context_lens", [start + num])
        self._put("last_row", [num - 1])
        self._put("block_table", list(table) + [self.pad_slot // bs] * (self.max_blocks - len(table)))
        if shape.lora is not None:
            self._fill_lora(num, bucket, step.slot_tables)
        self._copy(self.size)

    def fill_padding(self) -> None:
        """Every token padding, a context of one pad-block position (what graphs are captured over)."""
        n = self.max_tokens
        for _ in self._host_bufs:
            self._take_turn()
            pad_block = self.pad_slot // self.block_size
            for name, values in (("token_ids", [0] * n), ("positions", [0] * n), ("slot_mapping", [self.pad_slot] * n),
                                 ("query_start_loc", [0, 1]), ("seq_lens", [1]), ("context_lens", [1]),
                                 ("last_row", [0]), ("block_table", [pad_block] * self.max_blocks)):
                self._put(name, values)
            self._put_tiles([], 1, n, n // TILE_M)
            self._clear_slot_tables(self.kind_slices, TABLE_ROWS)
        self.device_buf.copy_(self.host_buf)

    def _fill_lora(self, num: int, bucket: int, slot_tables: dict[str, tuple[list, list, list]]) -> None:
        """Every chunk token on slot 0, cut into tiles of TILE_M; the bucket's other tiles empty on slot 1."""
        self._put_tiles([0] * num, 1, bucket, bucket // TILE_M)
        self._put_slot_tables(slot_tables, self.kind_slices, TABLE_ROWS)
