"""Batched multi-LoRA for one projection: every token carries its own adapter, each adapter its own rank.

Storage (the engine's device adapter pool, one buffer pair per layer and per output slice of a fused
projection such as q/k/v or gate/up), each adapter stored at its own rank, never padded:

    lora_a[s]: [num_rows_s, in_dim]    rows row_start[a, s] : row_start[a, s] + rank[a, s] hold A_a for slice s
    lora_b[s]: [num_rows_s, out_dim_s] the same rows hold B_a^T for slice s

Semantics, for every token t whose step slot a = token_slots[t] >= 0 and every slice s:

    y[t, off_s : off_s + out_dim_s] += scale[a, s] * (x[t] @ A_a,s^T) @ B_a,s^T

Tokens with slot -1 and slices with rank 0 leave y untouched. `LoRAStep` (once per step) and `LoRAProj`
(once per step and projection kind) are packed on the host by `prepare_*`, copied to the device in one
transfer each, and shared by every layer. `add_lora` dispatches to the reference (`add_lora_torch`) or to
the Triton kernels (`kernels/lora_triton.py`); `default_backend` is a device's when the engine's config names none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

BACKENDS = ("torch", "triton")
# Token tile heights of the Triton kernels (tl.dot needs >= 16 rows). A step takes the smallest height that
# cuts its slot groups into at most MAX_TILES tiles (a long segment is cut into several tiles of its slot):
# decode steps take 16 (one tile per adapter), one adapter with 64..512 tokens still 16 (more programs,
# docs/kernels.md), a prefill of 4 x 512 tokens 64.
TILE_HEIGHTS = (16, 32, 64)
MAX_TILES = 32
# Columns of a tile table row before the tile's token ids: slot, start in sorted_tokens, number of tokens.
TILE_HEAD = 3


@dataclass(frozen=True)
class LoRAStep:
    """Per-step token -> adapter map, shared by all layers and projections.

    The kernels' view of the same map: the LoRA tokens grouped by slot (`sorted_tokens`), cut into tiles of
    at most `block_m` tokens of one slot each. A `tiles` row holds everything a kernel program needs before
    it reads data (one dependent load): slot, first position in `sorted_tokens`, number of tokens, then the
    tile's token ids. Built by `prepare_lora_step`; left None by hand-made steps (then derived on demand).
    """

    token_slots: torch.Tensor  # [num_tokens] int64: the token's slot in this step's adapter table; -1 = none
    num_slots: int  # number of distinct adapters in the step (slot table length)
    has_lora: bool  # any token with an adapter at all; False skips every LoRA op
    sorted_tokens: torch.Tensor | None = None  # [num_lora_tokens] int64: token ids grouped by slot, stable
    # [num_tiles, TILE_HEAD + block_m] int64: (slot, start in sorted_tokens, num tokens, token ids padded with 0)
    tiles: torch.Tensor | None = None
    block_m: int = TILE_HEIGHTS[0]  # tile height: 16 is the decode launch shape, 64 the prefill one
    # Tile i is slot i (every slot fits one tile; slots without tokens have an empty tile): the kernels
    # read the slot's rank and rows at once, in parallel with the tile row.
    is_slot_tiles: bool = False
    num_lora_tokens: int = 0
    max_tile_count: int = 0  # the most tokens in one tile (<= block_m)

    @property
    def num_tiles(self) -> int:
        return 0 if self.tiles is None else self.tiles.shape[0]


@dataclass(frozen=True)
class LoRAProj:
    """Per-step pool addresses of each slot's adapter for one projection kind (e.g. "qkv")."""

    row_start: torch.Tensor  # [num_slots, num_slices] int64: first pool row of the slot's adapter, per slice
    rank: torch.Tensor  # [num_slots, num_slices] int64: 0 where the adapter does not adapt the slice
    scale: torch.Tensor  # [num_slots, num_slices] float32
    max_rank: tuple[int, ...]  # per slice, max of rank[:, s]: sizes the shrink buffer; 0 skips the slice
    # [num_slots, num_slices] int64, steps whose shrink is staged into the base matmul only (kernels/lora_triton.py:
    # add_lora_staged_triton): where the slot's shrink row of the slice starts past the base output's columns.
    t_col: torch.Tensor | None = None
    # [num_slots, num_slices] int64: first pool row of the slot's B^T, where the pool holds B^T at rows of its own
    # (engine/adapters/pool.py); None: the rows of its A (row_start)
    b_row_start: torch.Tensor | None = None
    # [num_slots, num_slices] int64: the row + 1 of the slot's DoRA output scale at the slice's width (0: plain
    # LoRA there; applied in the expand's store, add_lora_torch's reference); None: no slot of the step is DoRA
    dora_row: torch.Tensor | None = None
    # Host-side launch parameters a backend derives from this step's sizes, filled by the first layer's call
    # and reused by the others (the object lives for one step). Not part of the value.
    launch_cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def b_rows(self) -> torch.Tensor:
        """First pool row of each slot's B^T per slice."""
        return self.row_start if self.b_row_start is None else self.b_row_start


def _tile_height(counts: list[int], tile_heights: tuple[int, ...], max_tiles: int) -> int:
    """The smallest height that cuts the slot groups into at most max_tiles tiles (else the tallest)."""
    for height in tile_heights:
        if sum(-(-c // height) for c in counts) <= max_tiles or all(c <= height for c in counts):
            return height
    return tile_heights[-1]


def sort_by_slot(token_slots: Sequence[int] | np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, counts): the LoRA tokens' ids grouped by slot, stable, base tokens (-1) left out; tokens per slot
    [num_slots]."""
    slots = np.asarray(token_slots, dtype=np.int64).reshape(-1)
    is_lora = slots >= 0
    # Stable sort by slot with the no-adapter tokens (key num_slots) last, then cut them off.
    order = np.argsort(np.where(is_lora, slots, num_slots), kind="stable")
    counts = np.bincount(slots[is_lora], minlength=num_slots)
    return order[: int(counts.sum())], counts


def tile_table(counts: np.ndarray, order: np.ndarray, block_m: int, is_slot_tiles: bool = False,
               num_tiles: int | None = None) -> np.ndarray:
    """[num_tiles, TILE_HEAD + block_m] int64: each slot's group cut into tiles of at most block_m tokens, in slot
    order (a slot without tokens keeps one empty tile when is_slot_tiles); token ids past a tile's count are 0.
    num_tiles: a fixed tile count (static steps), the tiles past the step's empty and on slot counts.size, which
    the static layouts keep at rank 0 everywhere so those tiles move no bytes."""
    tiles_per_slot = -(-counts // block_m)
    if is_slot_tiles:
        tiles_per_slot = np.maximum(tiles_per_slot, 1)
    tile_slot = np.repeat(np.arange(counts.size), tiles_per_slot)
    group_start = np.cumsum(counts) - counts  # each slot's first position in order
    first_tile = np.cumsum(tiles_per_slot) - tiles_per_slot
    tile_first = (np.arange(tile_slot.size) - first_tile[tile_slot]) * block_m  # within the slot's group
    tile_start = group_start[tile_slot] + tile_first  # the tile's first position in order
    tile_count = np.minimum(block_m, counts[tile_slot] - tile_first)
    lanes = np.arange(block_m)
    is_token = lanes[None, :] < tile_count[:, None]
    tokens = np.where(is_token, order[np.where(is_token, tile_start[:, None] + lanes[None, :], 0)], 0)
    head = np.stack([tile_slot, tile_start, tile_count], axis=1)
    rows = np.concatenate([head, tokens], axis=1).astype(np.int64)
    if num_tiles is None:
        return rows
    assert rows.shape[0] <= num_tiles, (rows.shape[0], num_tiles)
    pad = np.zeros((num_tiles - rows.shape[0], TILE_HEAD + block_m), dtype=np.int64)
    pad[:, 0] = counts.size
    return np.concatenate([rows, pad])


@dataclass(frozen=True)
class TilePlan:
    """A step's LoRA tokens grouped by slot and cut into tiles, on the host (what `LoRAStep` holds on the device)."""

    order: np.ndarray  # [num_lora_tokens] int64: token ids grouped by slot, stable
    tiles: np.ndarray  # [num_tiles, TILE_HEAD + block_m] int64 (tile_table)
    block_m: int
    is_slot_tiles: bool
    max_tile_count: int  # the most tokens in one tile


def plan_tiles(token_slots: Sequence[int] | np.ndarray, num_slots: int, *, tile_heights: tuple[int, ...] = TILE_HEIGHTS,
               max_tiles: int = MAX_TILES) -> TilePlan:
    """The tile height (the smallest of tile_heights that cuts the slot groups into at most max_tiles tiles) and the
    tile table of an eager step; a decode step whose every slot fits one tile gets slot tiles (tile i is slot i)."""
    order, counts = sort_by_slot(token_slots, num_slots)
    counts_list = counts.tolist() if order.size else []
    block_m = _tile_height(counts_list, tile_heights, max_tiles)
    is_slot_tiles = bool(counts_list) and max(counts_list) <= block_m
    tiles = tile_table(counts if order.size else counts[:0], order, block_m, is_slot_tiles)
    return TilePlan(order, tiles, block_m, is_slot_tiles, min(max(counts_list, default=0), block_m))


def prepare_lora_step(
    token_slots: Sequence[int] | np.ndarray,
    num_slots: int,
    device: torch.device | str,
    *,
    tile_heights: tuple[int, ...] = TILE_HEIGHTS,
    max_tiles: int = MAX_TILES,
) -> LoRAStep:
    """A LoRAStep of its own device buffer (kernel tests and benchmarks; the engine's steps lay theirs out in
    engine/step/inputs.py): `plan_tiles`, packed into one host buffer, one copy to the device.

    token_slots: a list or an int array. tile_heights, max_tiles: as `plan_tiles` (the benchmark varies them).
    """
    slots = np.asarray(token_slots, dtype=np.int64).reshape(-1)
    plan = plan_tiles(slots, num_slots, tile_heights=tile_heights, max_tiles=max_tiles)
    num_tokens, num_lora_tokens = slots.size, plan.order.size
    packed = torch.from_numpy(np.concatenate([slots, plan.order, plan.tiles.reshape(-1)])).to(device)
    return LoRAStep(
        token_slots=packed[:num_tokens],
        num_slots=num_slots,
        has_lora=num_lora_tokens > 0,
        sorted_tokens=packed[num_tokens : num_tokens + num_lora_tokens],
        tiles=packed[num_tokens + num_lora_tokens :].view(-1, TILE_HEAD + plan.block_m),
        block_m=plan.block_m,
        is_slot_tiles=plan.is_slot_tiles,
        num_lora_tokens=num_lora_tokens,
        max_tile_count=plan.max_tile_count,
    )


def prepare_lora_proj(
    row_start: list[list[int]], rank: list[list[int]], scale: list[list[float]], device: torch.device | str
) -> LoRAProj:
    """Pack one projection's slot table (outer list: slots, inner: slices) into device tensors."""
    return prepare_lora_projs({"": (row_start, rank, scale)}, device)[""]


def prepare_lora_projs(
    tables: dict[str, tuple[list[list[int]], list[list[int]], list[list[float]]]], device: torch.device | str
) -> dict[str, LoRAProj]:
    """`prepare_lora_proj` for several projection kinds (kind -> (row_start, rank, scale)) in one host->device copy.

    The int64 tables and the float32 scales (two to an int64) are laid end to end, each from a 16-byte boundary,
    and every kind's tensors are views of the one device buffer.
    """
    parts: list[torch.Tensor] = []
    layout = []
    size = 0

    def place(values: torch.Tensor) -> int:  # 1-D int64; returns its first element's index in the buffer
        nonlocal size
        first = size
        parts.extend([values, values.new_zeros(values.numel() % 2)])
        size += values.numel() + values.numel() % 2
        return first

    for kind, (row_start, rank, scale) in tables.items():
        ranks = torch.tensor(rank, dtype=torch.int64).reshape(len(rank), -1)
        scales = torch.tensor(scale, dtype=torch.float32).flatten()
        scales = torch.cat([scales, scales.new_zeros(scales.numel() % 2)]).view(torch.int64)
        max_rank = tuple(max(column) for column in zip(*rank))  # host lists: no tensor op per step and kind
        rows = place(torch.tensor(row_start, dtype=torch.int64).flatten())
        layout.append((kind, ranks.shape, rows, place(ranks.flatten()), place(scales), max_rank))
    packed = torch.cat(parts).to(device)
    projs = {}
    for kind, shape, rows, ranks, scales, max_rank in layout:
        num = shape.numel()
        projs[kind] = LoRAProj(
            row_start=packed[rows : rows + num].view(shape),
            rank=packed[ranks : ranks + num].view(shape),
            scale=packed[scales : scales + (num + 1) // 2].view(torch.float32)[:num].view(shape),
            max_rank=max_rank,
        )
    return projs


def add_lora_torch(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    proj: LoRAProj,
    step: LoRAStep,
    bias: torch.Tensor | None = None,
) -> None:
    """Reference: y[t, off_s:off_s+d_s] += scale[a,s] * (x[t] @ A_{a,s}^T) @ B_{a,s}^T with a = slot of t; where
    proj.dora_row names the slot's DoRA output scales g (row dora_row - 1 of lora_b[s]), y[t, slice] becomes
    g * (y + delta - bias) + bias, PEFT's DoRA forward (bias [sum_s d_s] or None).

    y: [num_tokens, sum_s d_s], x: [num_tokens, in_dim], lora_a[s]: [num_rows_s, in_dim],
    lora_b[s]: [num_rows_s, d_s]. Per slice, one dense shrink against every slot's A, from which each token
    gathers its own slot's columns, then one expand per slot whose rows are kept only for that slot's tokens.
    Every mask selects (gather, where) and never multiplies by zero: 0 x NaN is NaN, so a slot whose rows
    hold NaN or infinities (or a lane past a rank reading another adapter's row) would otherwise reach every
    token of the step.
    """
    if not step.has_lora:
        return
    has_slot = step.token_slots >= 0
    slots = step.token_slots.clamp(min=0)
    offset = 0
    for s, (a_pool, b_pool) in enumerate(zip(lora_a, lora_b)):
        width = b_pool.shape[1]
        if proj.max_rank[s] > 0:
            delta = _slice_delta(x, a_pool, b_pool, proj, step.num_slots, slots, s)
            is_adapted = has_slot & (proj.rank[slots, s] > 0)  # rows to add into; the rest keep their bits
            y_slice = y[:, offset : offset + width]
            out = y_slice + delta.to(y.dtype)
            if proj.dora_row is not None:
                out = _dora_scale(out, b_pool, proj.dora_row[slots, s], None if bias is None else
                                  bias[offset : offset + width])
            y_slice.copy_(torch.where(is_adapted[:, None], out, y_slice))
        offset += width


def _dora_scale(y: torch.Tensor, pool: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """g * (y - bias) + bias per token whose g row (rows: row + 1, 0 none) names one; the others' y as it is."""
    g = pool[(rows - 1).clamp(min=0)].to(torch.float32)
    b = 0 if bias is None else bias.to(torch.float32)
    scaled = (g * (y.to(torch.float32) - b) + b).to(y.dtype)
    return torch.where((rows > 0)[:, None], scaled, y)


def _slot_rows(pool: torch.Tensor, proj: LoRAProj, s: int, row_start: torch.Tensor) -> torch.Tensor:
    """[num_slots, max_rank, dim]: each slot's rows of slice s from row_start, lanes past its rank exactly zero
    (selected)."""
    lanes = torch.arange(proj.max_rank[s], device=pool.device)
    valid = lanes < proj.rank[:, s, None]  # [num_slots, max_rank]
    rows = torch.where(valid, row_start[:, s, None] + lanes, 0)
    return torch.where(valid[..., None], pool[rows], torch.zeros((), dtype=pool.dtype, device=pool.device))


def _slice_delta(x: torch.Tensor, a_pool: torch.Tensor, b_pool: torch.Tensor, proj: LoRAProj, num_slots: int,
                 slots: torch.Tensor, s: int) -> torch.Tensor:
    """[num_tokens, d_s]: scale[a,s] * (x[t] @ A_{a,s}^T) @ B_{a,s}^T with a = slots[t], from a's rows only."""
    max_rank = proj.max_rank[s]
    a_slots, b_slots = _slot_rows(a_pool, proj, s, proj.row_start), _slot_rows(b_pool, proj, s, proj.b_rows)
    shrink_all = (x @ a_slots.reshape(-1, x.shape[1]).T).view(x.shape[0], num_slots, max_rank)
    index = slots[:, None, None].expand(-1, 1, max_rank)
    shrink = shrink_all.gather(1, index).squeeze(1) * proj.scale[slots, s].to(x.dtype)[:, None]  # [num_tokens, r]
    delta = torch.zeros(x.shape[0], b_pool.shape[1], dtype=x.dtype, device=x.device)
    for slot in range(num_slots):  # at most max_loras: one [num_tokens, r] x [r, d_s] product each
        delta = torch.where((slots == slot)[:, None], shrink @ b_slots[slot], delta)
    return delta


def default_backend(device: torch.device | str) -> str:
    """The LoRA backend a device runs when none is named: triton on CUDA, torch elsewhere."""
    return "triton" if torch.device(device).type == "cuda" else "torch"


@dataclass(frozen=True)
class LoRAOps:
    """One backend's ops, resolved once where the engine is built (the Triton ones import then: TRITON_INTERPRET
    is read at their import), so a layer calls what its step's context holds and imports nothing."""

    name: str  # one of BACKENDS
    add: Callable[..., None]  # add_lora_torch's signature
    # The expand of a shrink staged into the base matmul (kernels/lora_triton.py: add_lora_staged_triton); None:
    # the backend stages nothing
    add_staged: Callable[..., None] | None = None


def lora_ops(backend: str) -> LoRAOps:
    if backend not in BACKENDS:
        raise ValueError(f"LoRA backend {backend!r} is not allowed: use one of {', '.join(BACKENDS)}")
    if backend == "torch":
        return LoRAOps(backend, add_lora_torch)
    from kubelora.kernels.lora_triton import add_lora_staged_triton, add_lora_triton

    return LoRAOps(backend, add_lora_triton, add_lora_staged_triton)


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    proj: LoRAProj,
    step: LoRAStep,
    backend: str | LoRAOps = "torch",
    bias: torch.Tensor | None = None,
) -> None:
    """`backend`'s add (a name, or the ops the engine resolved once), skipped where nothing is adapted. bias: the
    projection's, which DoRA's scale leaves out (None: no bias)."""
    ops = backend if isinstance(backend, LoRAOps) else lora_ops(backend)
    if not step.has_lora or not any(proj.max_rank):  # e.g. the MLP of a step whose adapters adapt attention only
        return
    ops.add(y, x, lora_a, lora_b, proj, step, bias=bias)
