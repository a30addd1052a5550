"""Static step inputs: named regions of one int64 device buffer that CUDA graphs read, filled by one copy a step.

A captured graph reads its inputs from fixed device addresses, so every per-step value (token ids, positions,
slots, block tables, LoRA tiles and slot tables) lives in a region of one device buffer and a step writes new
values there. The host side is one int64 buffer (pinned on CUDA) per turn, two turns: a step is filled while
the previous step's copy may still be queued. `engine/step/decode.py` (decode steps) and
`engine/step/prefill.py` (one sequence's prefill) lay out their regions on this.

LoRA slot tables (row_start, rank, scale per slot and slice of each projection kind) are regions of `table_rows`
rows each; rows past a step's slots are zeros, so a slot index into them reads rank 0 and moves no bytes.
"""

from __future__ import annotations

import numpy as np
import torch

from kubelora.engine.model.llama import LoRAContext
from kubelora.engine.step.shape import TILE_M, StepShape
from kubelora.kernels.lora import TILE_HEAD, LoRAOps, LoRAProj, LoRAStep, sort_by_slot, tile_table


def table_regions(kind_slices: dict[str, int], table_rows: int) -> list[tuple[str, int]]:
    """The regions of each kind's slot tables: row_start, rank and scale (float32, two to an int64)."""
    regions = []
    for kind, slices in kind_slices.items():
        cells = table_rows * slices
        regions += [(f"{kind}.row_start", cells), (f"{kind}.rank", cells), (f"{kind}.scale", (cells + 1) // 2)]
    return regions


class StaticInputs:
    def __init__(self, layout: list[tuple[str, int]], device: torch.device) -> None:
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

    def _region(self, buf: torch.Tensor, name: str, length: int) -> torch.Tensor:
        first = self._offsets[name]
        return buf[first : first + length]

    def _put(self, name: str, values) -> None:
        first = self._offsets[name]
        self._host[first : first + len(values)] = values

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

    def _put_tiles(self, token_slots: list[int], num_slots: int, bucket: int, num_tiles: int) -> None:
        """The step's token -> slot map padded to bucket (-1), its LoRA tokens grouped by slot and their tile table
        (kernels/lora.py, the eager steps' builder): num_tiles tiles of TILE_M, those past the step's empty and on
        slot num_slots, whose table row is rank 0."""
        order, counts = sort_by_slot(token_slots, num_slots)
        self._put("token_slots", list(token_slots) + [-1] * (bucket - len(token_slots)))
        self._put("sorted_tokens", np.concatenate([order, np.zeros(bucket - order.size, dtype=np.int64)]))
        self._put("tiles", tile_table(counts, order, TILE_M, num_tiles=num_tiles).reshape(-1))

    def lora_context(self, shape: StepShape, ops: LoRAOps) -> LoRAContext | None:
        """The LoRA half of a step's ForwardContext, over the layout's regions (None: the base graph's); the
        kinds its shape stages compute their shrink in the base matmul."""
        if shape.lora is None:
            return None
        return LoRAContext(step=self.lora_step(shape.bucket, shape.lora), proj=self.lora_projs(shape.lora), ops=ops,
                           stage=dict(shape.lora.stage))

    def _lora_step(self, bucket: int, num_tiles: int, num_slots: int, rows: int) -> LoRAStep:
        """The LoRAStep over the tile regions: num_tiles tiles of TILE_M for a bucket of tokens, tiles reading at
        most `rows` tokens each (LoRAShape.rows); sizes from shapes only, so a graph replays it."""
        tiles = self._region(self.device_buf, "tiles", num_tiles * (TILE_HEAD + TILE_M))
        return LoRAStep(token_slots=self._region(self.device_buf, "token_slots", bucket), num_slots=num_slots,
                        has_lora=True, sorted_tokens=self._region(self.device_buf, "sorted_tokens", bucket),
                        tiles=tiles.view(num_tiles, TILE_HEAD + TILE_M), block_m=TILE_M, is_slot_tiles=False,
                        num_lora_tokens=bucket, max_tile_count=rows)

    def _put_slot_tables(self, slot_tables: dict[str, tuple[list, list, list]], kind_slices: dict[str, int],
                         table_rows: int) -> None:
        """Each kind's (row_start, rank, scale) per slot and slice; rows past the slots zero."""
        for kind, slices in kind_slices.items():
            row_start, rank, scale = slot_tables[kind]
            blank = (table_rows - len(rank)) * slices
            self._put(f"{kind}.row_start", [v for r in row_start for v in r] + [0] * blank)
            self._put(f"{kind}.rank", [v for r in rank for v in r] + [0] * blank)
            scales = np.zeros(2 * ((table_rows * slices + 1) // 2), dtype=np.float32)
            scales[: len(rank) * slices] = [v for r in scale for v in r]
            self._put(f"{kind}.scale", scales.view(np.int64))

    def _clear_slot_tables(self, kind_slices: dict[str, int], table_rows: int) -> None:
        for name, length in table_regions(kind_slices, table_rows):
            self._put(name, [0] * length)

    def _slot_projs(self, kind_slices: dict[str, int], table_rows: int, kinds: tuple[str, ...], lanes: int,
                    t_cols: dict[str, torch.Tensor] | None = None) -> dict[str, LoRAProj]:
        """Each kind's LoRAProj over its table regions; kinds outside `kinds` get max_rank 0 (no launch)."""
        projs = {}
        for kind, slices in kind_slices.items():
            cells = table_rows * slices
            scale = self._region(self.device_buf, f"{kind}.scale", (cells + 1) // 2).view(torch.float32)[:cells]
            projs[kind] = LoRAProj(
                row_start=self._region(self.device_buf, f"{kind}.row_start", cells).view(table_rows, slices),
                rank=self._region(self.device_buf, f"{kind}.rank", cells).view(table_rows, slices),
                scale=scale.view(table_rows, slices),
                max_rank=(lanes if kind in kinds else 0,) * slices, t_col=(t_cols or {}).get(kind))
        return projs
