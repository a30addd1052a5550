"""The device adapter pool: per layer and module, rank rows at each adapter's own rank (kernels/lora.py layout).

Each module (q_proj, ..., down_proj) has one A buffer `[num_layers, num_rows, in_dim]` and one B^T buffer
`[num_layers, num_rows, out_dim]`; every layer uses the same row addresses, so one `RowAllocator` per module
places an adapter: `rank` contiguous rows in each module it adapts, nothing in the others. The pool's bytes
are `num_rows * bytes_per_row(module)` summed over modules; an adapter costs `rank * bytes_per_row` per module.
Mutated only between steps (placement and compaction happen in `schedule()`, frees under the manager lock).
"""

from __future__ import annotations

from bisect import insort
from dataclasses import dataclass

import torch

from kubelora.engine.adapters.spec import HostAdapter
from kubelora.engine.model.config import LORA_MODULES, PROJ_KINDS, ModelConfig
from kubelora.engine.model.llama import LayerLoRABuffers


class RowAllocator:
    """First-fit allocator of contiguous row ranges in [0, num_rows)."""

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self._free: list[tuple[int, int]] = [(0, num_rows)] if num_rows else []  # sorted (start, length)

    @property
    def num_free(self) -> int:
        return sum(length for _, length in self._free)

    def allocate(self, num_rows: int) -> int | None:
        for i, (start, length) in enumerate(self._free):
            if length >= num_rows:
                self._free[i : i + 1] = [(start + num_rows, length - num_rows)] if length > num_rows else []
                return start
        return None

    def free(self, start: int, num_rows: int) -> None:
        insort(self._free, (start, num_rows))
        merged: list[tuple[int, int]] = []
        for begin, length in self._free:
            if merged and merged[-1][0] + merged[-1][1] == begin:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((begin, length))
        self._free = merged

    def reset(self, used: int) -> None:
        """After compaction: rows [0, used) taken, the rest free."""
        self._free = [(used, self.num_rows - used)] if used < self.num_rows else []


@dataclass(frozen=True)
class SlotView:
    """Where one resident adapter lives in the pool, for one step's slot table (read by prepare_lora_*)."""

    row_start: dict[str, int]  # module -> first row
    rank: dict[str, int]  # module -> rank rows (absent: module not adapted)
    scale: dict[str, float]
    placement: int = -1  # unique per placement of an adapter into the pool (staged copies are keyed by it)


class DeviceLoRAPool:
    def __init__(self, model: ModelConfig, num_rows: int, dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.num_rows = num_rows
        self.dtype = dtype
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        for module in LORA_MODULES:
            in_dim, out_dim = model.module_dims(module)
            self.a[module] = torch.zeros(model.num_layers, num_rows, in_dim, dtype=dtype, device=device)
            self.b[module] = torch.zeros(model.num_layers, num_rows, out_dim, dtype=dtype, device=device)
        self._allocators = {module: RowAllocator(num_rows) for module in LORA_MODULES}
        self._placements: dict[int, dict[str, tuple[int, int]]] = {}  # owner -> module -> (start, rank)
        self._placement_ids: dict[int, int] = {}  # owner -> its placement's id (a new one for every place)
        self._next_placement = 0

    @staticmethod
    def bytes_per_rank(model: ModelConfig, dtype: torch.dtype) -> int:
        """Bytes of one rank row in every module (all targets), across all layers."""
        return sum(row_bytes(model, m, dtype) for m in LORA_MODULES)

    @property
    def total_bytes(self) -> int:
        return self.num_rows * self.bytes_per_rank(self.model, self.dtype)

    @property
    def used_bytes(self) -> int:
        return sum(self.bytes_for(ranks) for ranks in self._rank_maps())

    def bytes_for(self, ranks: dict[str, int]) -> int:
        return sum(rank * row_bytes(self.model, m, self.dtype) for m, rank in ranks.items())

    def layer_buffers(self) -> list[LayerLoRABuffers]:
        """Per-layer views grouped by projection kind, in slice order; valid for the pool's lifetime."""
        out = []
        for layer in range(self.model.num_layers):
            kinds = {kind: self.model.kind_modules(kind) for kind in PROJ_KINDS}
            out.append(LayerLoRABuffers(
                lora_a={kind: [self.a[m][layer] for m in mods] for kind, mods in kinds.items()},
                lora_b={kind: [self.b[m][layer] for m in mods] for kind, mods in kinds.items()},
            ))
        return out

    def free_rows(self, module: str) -> int:
        return self._allocators[module].num_free

    def place(self, owner: int, ranks: dict[str, int], host: HostAdapter) -> bool:
        """Copy an adapter in; False (nothing changed) when some module lacks room even after compaction."""
        if owner in self._placements:
            return True
        if any(self._allocators[m].num_free < r for m, r in ranks.items()):
            return False
        placement = self._allocate(ranks)
        if placement is None:
            self.compact()
            placement = self._allocate(ranks)
        if placement is None:
            return False
        for module, (start, rank) in placement.items():
            self.a[module][:, start : start + rank].copy_(host.a[module], non_blocking=True)
            self.b[module][:, start : start + rank].copy_(host.b[module], non_blocking=True)
        self._placements[owner] = placement
        self._placement_ids[owner] = self._next_placement
        self._next_placement += 1
        return True

    def free(self, owner: int) -> None:
        self._placement_ids.pop(owner, None)
        for module, (start, rank) in self._placements.pop(owner, {}).items():
            self._allocators[module].free(start, rank)

    def view(self, owner: int, scales: dict[str, float]) -> SlotView:
        placement = self._placements[owner]
        return SlotView(row_start={m: s for m, (s, _) in placement.items()},
                        rank={m: r for m, (_, r) in placement.items()}, scale=dict(scales),
                        placement=self._placement_ids[owner])

    def fill(self, owner: int, value: float, *, is_a: bool = True, is_b: bool = True) -> None:
        """Set a placed adapter's A and/or B rows to `value` in every layer and module it adapts.

        For tests only: loads refuse non-finite weights, so this is how a test puts NaN or infinities into the
        pool to check that no other adapter's tokens see them (copies staged before the call keep their values).
        """
        for module, (start, rank) in self._placements[owner].items():
            for buf, is_filled in ((self.a[module], is_a), (self.b[module], is_b)):
                if is_filled:
                    buf[:, start : start + rank] = value

    def compact(self) -> None:
        """Pack every module's placements to the front (rows move down, in address order: no overlap hazard)."""
        for module, allocator in self._allocators.items():
            owners = sorted((p[module][0], o) for o, p in self._placements.items() if module in p)
            next_row = 0
            for start, owner in owners:
                rank = self._placements[owner][module][1]
                if start != next_row:
                    for buf in (self.a[module], self.b[module]):
                        buf[:, next_row : next_row + rank] = buf[:, start : start + rank].clone()
                    self._placements[owner][module] = (next_row, rank)
                next_row += rank
            allocator.reset(next_row)

    def _allocate(self, ranks: dict[str, int]) -> dict[str, tuple[int, int]] | None:
        placement = {}
        for module, rank in ranks.items():
            start = self._allocators[module].allocate(rank)
            if start is None:
                for m, (s, r) in placement.items():
                    self._allocators[m].free(s, r)
                return None
            placement[module] = (start, rank)
        return placement

    def _rank_maps(self):
        return ({m: r for m, (_, r) in p.items()} for p in self._placements.values())


def row_bytes(model: ModelConfig, module: str, dtype: torch.dtype) -> int:
    """Bytes of one rank row of one module across all layers (A row + B^T row)."""
    in_dim, out_dim = model.module_dims(module)
    return model.num_layers * (in_dim + out_dim) * torch.empty((), dtype=dtype).element_size()
