"""The device adapter pool: one arena of bytes, paged per module, each adapter at its own modules and ranks.

The arena is `[num_layers, arena_len]` elements of the pool's dtype; every allocation takes the same element range
of every layer's strip. A module's A rows and its B^T rows are two allocations, each read through a view of the
arena at the module's own row width (A: in_dim, B^T: out_dim), so the kernels see `[num_rows, width]` buffers per
layer with contiguous rows (kernels/lora.py layout), A and B^T at rows of their own (`SlotView.row_start`,
`b_row_start`). An allocation starts at a multiple of its width; an adapter takes the elements of the modules and
ranks it has, nothing else.

- DoRA: one more allocation per module, one row of out_dim: magnitude / ||W + scale * B A|| per output channel
  (the norm detached, as PEFT computes it), computed from the base weight when the adapter is placed.
- Vocabulary-wide modules (embed_tokens, lm_head) have one matrix for the whole model, not one per layer: their
  rows are cut into num_layers pieces, piece l in layer l's strip, so they take their own bytes and no more. A
  logical row is its pieces laid end to end (kernels/lora_formats.py: `vocab_rows`).

What an adapter costs (`adapter_bytes`): per allocation its elements plus the alignment its start may need (less
than one row); the sum over what the pool holds never exceeds the arena after compaction (which packs allocations
to the front, each to the next multiple of its width). So adapters whose `adapter_bytes` sum to at most
`total_bytes` can all be resident at once: the guarantee the engine reports (`/v1/models`' adapter_pool_bytes).
Mutated only between steps (placement and compaction happen in `schedule()`, frees under the manager lock).
"""

from __future__ import annotations

import math
from bisect import insort
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kubelora.engine.adapters.spec import AdapterSpec, HostAdapter
from kubelora.engine.model.config import LORA_MODULES, PROJ_KINDS, ModelConfig
from kubelora.engine.model.llama import LayerLoRABuffers

VOCAB_MODULES = ("embed_tokens", "lm_head")
# Step table kinds beyond the projections: one slice each (engine/step/inputs.py)
VOCAB_KINDS = {"embed": ("embed_tokens",), "lm_head": ("lm_head",)}
BaseWeight = Callable[[int, str], torch.Tensor]  # (layer, module) -> W [out_dim, in_dim] as the model holds it


class RowAllocator:
    """First-fit allocator of contiguous ranges in [0, num_rows), each starting at a multiple of its alignment."""

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self._free: list[tuple[int, int]] = [(0, num_rows)] if num_rows else []  # sorted (start, length)

    @property
    def num_free(self) -> int:
        return sum(length for _, length in self._free)

    def allocate(self, num_rows: int, align: int = 1) -> int | None:
        for i, (start, length) in enumerate(self._free):
            first = -(-start // align) * align
            if first + num_rows <= start + length:
                pieces = [(start, first - start), (first + num_rows, start + length - first - num_rows)]
                self._free[i : i + 1] = [p for p in pieces if p[1] > 0]
                return first
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

    def reset_to(self, taken: list[tuple[int, int]]) -> None:
        """Only the (start, length) ranges of `taken` (sorted, disjoint) taken, every gap between them free."""
        self._free, cursor = [], 0
        for start, length in [*taken, (self.num_rows, 0)]:
            if start > cursor:
                self._free.append((cursor, start - cursor))
            cursor = start + length


@dataclass(frozen=True)
class SlotView:
    """Where one resident adapter lives in the pool, for one step's slot table (read by prepare_lora_*)."""

    row_start: dict[str, int]  # module -> first row of its A
    rank: dict[str, int]  # module -> rank rows (absent: module not adapted)
    scale: dict[str, float]
    placement: int = -1  # unique per placement of an adapter into the pool (staged copies are keyed by it)
    b_row_start: dict[str, int] | None = None  # module -> first row of its B^T (None: the A rows' numbers)
    dora_row: dict[str, int] | None = None  # module -> row of its DoRA output scale (absent: plain LoRA)

    def b_row(self, module: str) -> int:
        return (self.b_row_start if self.b_row_start is not None else self.row_start).get(module, 0)


# (module, part): part "a" (A rows), "b" (B^T rows) or "g" (DoRA's output scale)
_Key = tuple[str, str]


def module_dims(model: ModelConfig, module: str) -> tuple[int, int]:
    """(in_dim, out_dim) of any adaptable module, the vocabulary-wide ones included (PEFT's lora_A, lora_B sizes:
    embed_tokens' A is [r, vocab], its B [hidden, r])."""
    if module == "embed_tokens":
        return model.vocab_size, model.hidden_size
    if module == "lm_head":
        return model.hidden_size, model.vocab_size
    return model.module_dims(module)


def part_width(model: ModelConfig, module: str, part: str) -> int:
    """Elements of one row of a module's part in one layer's strip (a vocabulary module's row is cut in pieces)."""
    in_dim, out_dim = module_dims(model, module)
    dim = in_dim if part == "a" else out_dim
    return -(-dim // model.num_layers) if module in VOCAB_MODULES else dim


def _widths(model: ModelConfig) -> list[int]:
    modules = (*LORA_MODULES, *VOCAB_MODULES)
    return [part_width(model, m, p) for m in modules for p in ("a", "b")]


def module_costs(model: ModelConfig, dtype: torch.dtype) -> dict[str, dict[str, int]]:
    """What each module costs an adapter in the pool, in bytes: module -> {"per_rank", "fixed", "dora"}; an adapter
    takes sum over its modules of rank * per_rank + fixed (+ dora with DoRA). per_rank: one A row and one B^T row
    in every layer; fixed: the alignment each of the two allocations may need at most (less than a row: its width
    less the widths' common divisor); dora: the output-scale row and its alignment (absent: DoRA not served there)."""
    unit = math.gcd(*_widths(model))
    scale = model.num_layers * torch.empty((), dtype=dtype).element_size()
    costs = {}
    for module in (*LORA_MODULES, *VOCAB_MODULES):
        a, b = part_width(model, module, "a"), part_width(model, module, "b")
        costs[module] = {"per_rank": scale * (a + b), "fixed": scale * (a + b - 2 * unit)}
        if module not in VOCAB_MODULES:
            costs[module]["dora"] = scale * (2 * b - unit)
    return costs


def adapter_bytes(model: ModelConfig, dtype: torch.dtype, ranks: dict[str, int], dora: bool = False) -> int:
    """Pool bytes an adapter of these ranks takes at most (`module_costs`)."""
    costs = module_costs(model, dtype)
    return sum(rank * costs[m]["per_rank"] + costs[m]["fixed"] + (costs[m].get("dora", 0) if dora else 0)
               for m, rank in ranks.items())


def spec_bytes(model: ModelConfig, dtype: torch.dtype, spec: AdapterSpec) -> int:
    return adapter_bytes(model, dtype, spec.ranks, spec.use_dora)


class DeviceLoRAPool:
    def __init__(self, model: ModelConfig, num_rows: int, dtype: torch.dtype, device: torch.device,
                 num_bytes: int | None = None) -> None:
        """num_rows: the arena holds num_rows rank rows of every projection module (`bytes_per_rank` each);
        num_bytes: its bytes instead (rounded down to whole elements of every layer)."""
        self.model = model
        self.num_rows = num_rows
        self.dtype = dtype
        element = torch.empty((), dtype=dtype).element_size()
        self.arena_len = (num_rows * sum(sum(model.module_dims(m)) for m in LORA_MODULES) if num_bytes is None
                          else num_bytes // (model.num_layers * element))
        self.arena = torch.zeros(model.num_layers, self.arena_len, dtype=dtype, device=device)
        self._views: dict[int, torch.Tensor] = {}
        self.a = {m: self.rows_view(part_width(model, m, "a")) for m in (*LORA_MODULES, *VOCAB_MODULES)}
        self.b = {m: self.rows_view(part_width(model, m, "b")) for m in (*LORA_MODULES, *VOCAB_MODULES)}
        self._allocator = RowAllocator(self.arena_len)
        self._placements: dict[int, dict[_Key, tuple[int, int]]] = {}  # owner -> key -> (first element, elements)
        self._placement_ids: dict[int, int] = {}  # owner -> its placement's id (a new one for every place)
        self._costs: dict[int, int] = {}  # owner -> adapter_bytes
        self._next_placement = 0
        self._base_weight: BaseWeight | None = None

    def set_base_weight(self, base_weight: BaseWeight) -> None:
        """Where DoRA adapters' norms read W (the served model's weights, on the pool's device)."""
        self._base_weight = base_weight

    def rows_view(self, width: int) -> torch.Tensor:
        """The arena as rows of `width` elements: [num_layers, arena_len // width, width] (shared storage)."""
        if width not in self._views:
            self._views[width] = self.arena.as_strided((self.model.num_layers, self.arena_len // width, width),
                                                       (self.arena_len, width, 1))
        return self._views[width]

    @staticmethod
    def bytes_per_rank(model: ModelConfig, dtype: torch.dtype) -> int:
        """Bytes of one rank row in every projection module, across all layers: the arena's unit of size."""
        costs = module_costs(model, dtype)
        return sum(costs[m]["per_rank"] for m in LORA_MODULES)

    @property
    def total_bytes(self) -> int:
        return self.arena.numel() * self.arena.element_size()

    @property
    def used_bytes(self) -> int:
        """Bytes the resident adapters are counted at (`adapter_bytes`): what the room guarantee spends."""
        return sum(self._costs.values())

    def free_bytes(self) -> int:
        return self.total_bytes - self.used_bytes

    def layer_buffers(self) -> list[LayerLoRABuffers]:
        """Per-layer views grouped by projection kind, in slice order; valid for the pool's lifetime."""
        out = []
        vocab = {m: (self.a[m], self.b[m]) for m in VOCAB_MODULES}
        for layer in range(self.model.num_layers):
            kinds = {kind: self.model.kind_modules(kind) for kind in PROJ_KINDS}
            out.append(LayerLoRABuffers(
                lora_a={kind: [self.a[m][layer] for m in mods] for kind, mods in kinds.items()},
                lora_b={kind: [self.b[m][layer] for m in mods] for kind, mods in kinds.items()},
                vocab=vocab,
            ))
        return out

    def place(self, owner: int, spec: AdapterSpec, host: HostAdapter) -> bool:
        """Copy an adapter in (DoRA: its output scales computed from W); False (nothing changed) when the arena
        lacks room even after compaction."""
        if owner in self._placements:
            return True
        cost = spec_bytes(self.model, self.dtype, spec)
        if cost > self.free_bytes():
            return False
        sizes = self._sizes(spec)
        placement = self._allocate(sizes)
        if placement is None:
            self.compact()
            placement = self._allocate(sizes)
        if placement is None:
            return False
        for (module, part), (start, length) in placement.items():
            if part != "g":
                host_rows = (host.a if part == "a" else host.b)[module]
                self.arena[:, start : start + length].copy_(host_rows.reshape(self.model.num_layers, -1),
                                                            non_blocking=True)
        if spec.use_dora:
            self._place_dora(spec, host, placement)
        self._placements[owner] = placement
        self._placement_ids[owner] = self._next_placement
        self._costs[owner] = cost
        self._next_placement += 1
        return True

    def free(self, owner: int) -> None:
        self._placement_ids.pop(owner, None)
        self._costs.pop(owner, None)
        for start, length in self._placements.pop(owner, {}).values():
            self._allocator.free(start, length)

    def view(self, owner: int, scales: dict[str, float]) -> SlotView:
        placement = self._placements[owner]
        rows = {key: start // self._width(key) for key, (start, _) in placement.items()}
        ranks = {m: length // self._width((m, p)) for (m, p), (_, length) in placement.items() if p == "a"}
        return SlotView(row_start={m: r for (m, p), r in rows.items() if p == "a"}, rank=ranks,
                        scale=dict(scales), placement=self._placement_ids[owner],
                        b_row_start={m: r for (m, p), r in rows.items() if p == "b"},
                        dora_row={m: r for (m, p), r in rows.items() if p == "g"})

    def fill(self, owner: int, value: float, *, is_a: bool = True, is_b: bool = True) -> None:
        """Set a placed adapter's A and/or B rows (with B, DoRA's output scales) to `value` in every layer and module
        it adapts.

        For tests only: loads refuse non-finite weights, so this is how a test puts NaN or infinities into the
        pool to check that no other adapter's tokens see them (copies staged before the call keep their values).
        """
        for (_, part), (start, length) in self._placements[owner].items():
            if (part == "a" and is_a) or (part in ("b", "g") and is_b):
                self.arena[:, start : start + length] = value

    def compact(self) -> None:
        """Pack every allocation to the front, each at the next multiple of its width (elements move down, in
        address order: a move never overwrites what is still to move)."""
        allocations = sorted((start, owner, key) for owner, p in self._placements.items()
                             for key, (start, _) in p.items())
        end = 0
        for start, owner, key in allocations:
            width = self._width(key)
            length = self._placements[owner][key][1]
            first = -(-end // width) * width
            if first != start:
                self.arena[:, first : first + length] = self.arena[:, start : start + length].clone()
                self._placements[owner][key] = (first, length)
            end = first + length
        self._allocator.reset_to(sorted(p for placement in self._placements.values() for p in placement.values()))

    def _width(self, key: _Key) -> int:
        module, part = key
        return part_width(self.model, module, "b" if part == "g" else part)

    def _sizes(self, spec: AdapterSpec) -> dict[_Key, int]:
        sizes = {}
        for module, rank in spec.ranks.items():
            sizes[(module, "a")] = rank * part_width(self.model, module, "a")
            sizes[(module, "b")] = rank * part_width(self.model, module, "b")
            if spec.use_dora and module not in VOCAB_MODULES:
                sizes[(module, "g")] = part_width(self.model, module, "b")
        return sizes

    def _allocate(self, sizes: dict[_Key, int]) -> dict[_Key, tuple[int, int]] | None:
        placement = {}
        for key, length in sizes.items():
            start = self._allocator.allocate(length, self._width(key))
            if start is None:
                for s, n in placement.values():
                    self._allocator.free(s, n)
                return None
            placement[key] = (start, length)
        return placement

    def _place_dora(self, spec: AdapterSpec, host: HostAdapter, placement: dict[_Key, tuple[int, int]]) -> None:
        """magnitude / ||W + scale * B A|| per output channel and layer (PEFT's DoRA weight norm: over each output
        row of the merged weight, in float32, detached), into the module's "g" row."""
        if self._base_weight is None:
            raise RuntimeError("DoRA adapters need the pool's base weights (set_base_weight)")
        device = self.arena.device
        for module in spec.ranks:
            if (module, "g") not in placement:
                continue
            start, length = placement[(module, "g")]
            a = host.a[module].to(device, torch.float32)  # [layers, rank, in]
            b = host.b[module].to(device, torch.float32)  # [layers, rank, out] (B^T)
            magnitude = host.magnitude[module].to(device, torch.float32)  # [layers, out]
            for layer in range(self.model.num_layers):
                weight = self._base_weight(layer, module).float()
                merged = weight + spec.scales[module] * (b[layer].T @ a[layer])
                norm = torch.linalg.norm(merged, dim=1)
                self.arena[layer, start : start + length] = magnitude[layer] / norm


def table_modules(model: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Every step table kind -> its modules in slice order: the projection kinds, then the vocabulary kinds."""
    return {**{kind: model.kind_modules(kind) for kind in PROJ_KINDS}, **VOCAB_KINDS}


def slot_tables(slots: tuple[SlotView, ...], kinds: dict[str, tuple[str, ...]]) -> dict[str, tuple[list, ...]]:
    """A step's slot tables: kind -> (row_start, rank, scale, b_row_start, dora_row + 1 or 0), each per slot and
    module of the kind (engine/step/inputs.py lays them out)."""
    tables = {}
    for kind, modules in kinds.items():
        tables[kind] = ([[view.row_start.get(m, 0) for m in modules] for view in slots],
                        [[view.rank.get(m, 0) for m in modules] for view in slots],
                        [[view.scale.get(m, 0.0) for m in modules] for view in slots],
                        [[view.b_row(m) for m in modules] for view in slots],
                        [[(view.dora_row or {}).get(m, -1) + 1 for m in modules] for view in slots])
    return tables
