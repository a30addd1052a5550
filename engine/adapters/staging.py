"""Staged shrinks: a decode step's adapters' A rows appended to the base weight, so one matmul computes both.

For a staged projection kind (q/k/v and o by default) the base weight lives inside a taller buffer
`[num_layers, out_dim + capacity, in_dim]` (engine/model/weights.py: extend_weights). Rows past out_dim hold
the A rows of the adapters decode steps use, copied from the device pool (engine/adapters/pool.py), so
`x @ buffer[layer, :out_dim + rows]^T` is the base output followed by every token's shrink against every
staged adapter, in one cuBLAS launch that streams those rows with the weights; the expand launch then reads
each token's own rows (kernels/lora_triton.py: add_lora_staged_triton). At batch 64 the matmul's extra rows
cost less than the shrink launch they replace (docs/benchmarks-engine.md); the extra products (every token
against every staged adapter) are compute a weight-streaming matmul has to spare.

Placement: an adapter placement (`SlotView.placement`) takes the sum of its ranks over the kind's modules in
contiguous rows, modules in the kind's slice order, and stays staged across steps (a decode batch keeps its
adapters for many steps) until its rows are needed. A step stages what it lacks, evicting staged adapters it
does not use; the matmul reads rows up to the highest one the step uses, rounded up to a bucket
(engine/step/shape.py: `stage_bucket`, part of the CUDA graph key), and a step whose rows lie spread out is staged again from row 0.
A step needing more rows than the capacity runs the shrink launch instead (`stage` returns None). Copies run
on the current stream, so they follow the steps in flight that read the rows they overwrite.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kubelora.engine.adapters.pool import DeviceLoRAPool, RowAllocator, SlotView
from kubelora.engine.step.shape import stage_bucket

STAGED_KINDS = ("qkv", "o")
ROWS_PER_SLICE = 1024  # staging capacity at most: this many rows per module (64 adapters of rank 16)


@dataclass(frozen=True)
class StagedStep:
    """What a step's staged kinds read: rows past the base output, and each slot's first row per slice."""

    rows: dict[str, int]  # kind -> the matmul's extra rows (a bucket); 0: no adapter of the step adapts the kind
    t_col: dict[str, list[list[int]]]  # kind -> per slot, per slice: first staged row of its A (0 at rank 0)


class ShrinkStaging:
    def __init__(self, buffers: dict[str, torch.Tensor], base_rows: dict[str, int],
                 modules: dict[str, tuple[str, ...]], pool: DeviceLoRAPool) -> None:
        """buffers: kind -> [num_layers, base_rows + capacity, in_dim], the base weight in its first rows."""
        self.buffers = buffers
        self.base_rows = dict(base_rows)
        self.modules = dict(modules)
        self.pool = pool
        self.capacity = {kind: buf.shape[1] - base_rows[kind] for kind, buf in buffers.items()}
        self._alloc = {kind: RowAllocator(cap) for kind, cap in self.capacity.items()}
        self._staged: dict[str, dict[int, tuple[int, int]]] = {kind: {} for kind in buffers}  # placement -> rows
        self.num_copies = 0  # adapters copied in (tests, logs)
        self._last: tuple[tuple[int, ...], StagedStep | None] | None = None  # the last step's placements, result

    def stage(self, slots: tuple[SlotView, ...]) -> StagedStep | None:
        """Stage the step's adapters (one SlotView per step slot); None when some kind lacks the capacity."""
        placements = tuple(view.placement for view in slots)
        if self._last is not None and self._last[0] == placements:  # a decode batch's next step: nothing moves
            return self._last[1]
        staged = self._stage(slots)
        self._last = (placements, staged)
        return staged

    def _stage(self, slots: tuple[SlotView, ...]) -> StagedStep | None:
        needs = {kind: [sum(view.rank.get(m, 0) for m in mods) for view in slots]
                 for kind, mods in self.modules.items()}
        if any(sum(need) > self.capacity[kind] for kind, need in needs.items()):
            return None
        rows, t_col = {}, {}
        for kind, need in needs.items():
            starts = self._place(kind, slots, need)
            end = max((start + n for start, n in zip(starts, need) if n), default=0)
            if stage_bucket(end, self.capacity[kind]) > stage_bucket(sum(need), self.capacity[kind]):
                self._reset(kind)  # spread out: the matmul would read other adapters' rows
                starts = self._place(kind, slots, need)
                end = sum(need)
            rows[kind] = stage_bucket(end, self.capacity[kind])
            t_col[kind] = [self._slice_starts(kind, view, start) for view, start in zip(slots, starts)]
        return StagedStep(rows, t_col)

    def _slice_starts(self, kind: str, view: SlotView, start: int) -> list[int]:
        out, row = [], start
        for module in self.modules[kind]:
            rank = view.rank.get(module, 0)
            out.append(row if rank else 0)
            row += rank
        return out

    def _place(self, kind: str, slots: tuple[SlotView, ...], need: list[int]) -> list[int]:
        staged, alloc = self._staged[kind], self._alloc[kind]
        used = {view.placement for view, n in zip(slots, need) if n}
        starts = []
        for view, n in zip(slots, need):
            if n == 0:
                starts.append(0)
                continue
            if view.placement in staged:
                starts.append(staged[view.placement][0])
                continue
            start = alloc.allocate(n)
            if start is None:  # evict the staged adapters this step does not use
                for placement in [p for p in staged if p not in used]:
                    alloc.free(*staged.pop(placement))
                start = alloc.allocate(n)
            if start is None:  # fragmented: the step's own rows from row 0 (they fit: checked by `stage`)
                self._reset(kind)
                return self._place(kind, slots, need)
            staged[view.placement] = (start, n)
            self._copy(kind, view, start)
            starts.append(start)
        return starts

    def _reset(self, kind: str) -> None:
        self._staged[kind].clear()
        self._alloc[kind].reset(0)

    def _copy(self, kind: str, view: SlotView, start: int) -> None:
        row = self.base_rows[kind] + start
        buf = self.buffers[kind]
        for module in self.modules[kind]:
            rank = view.rank.get(module, 0)
            if rank:
                first = view.row_start[module]
                buf[:, row : row + rank].copy_(self.pool.a[module][:, first : first + rank])
                row += rank
        self.num_copies += 1
