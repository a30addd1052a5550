"""Device side of the per-step tile table (`LoRAStep.tiles`), shared by the LoRA kernels.

A program's first loads are its tile row and its slot's (rank, first row, scale). With slot tiles (tile i
is slot i) and the tile's token ids in its row, both are one round trip, issued together, before any data
is read.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kubelora.kernels.lora import TILE_HEAD

_HEAD = tl.constexpr(TILE_HEAD)

try:  # Hopper programmatic dependent launch (griddepcontrol); absent from older Triton builds
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_PDL = True
except ImportError:  # pragma: no cover
    HAS_PDL = False

    @triton.jit
    def gdc_launch_dependents():
        pass

    @triton.jit
    def gdc_wait():
        pass


@functools.cache
def _has_griddepcontrol(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def uses_pdl(is_pdl: bool, device: torch.device) -> bool:
    """is_pdl where it can run: a CUDA device of compute capability >= 9 (not the CPU interpreter)."""
    return is_pdl and HAS_PDL and _has_griddepcontrol(device)


@triton.jit
def tile_meta(tiles_ptr, tile, BLOCK_M: tl.constexpr, SLOT_TILES: tl.constexpr):
    """(slot, start in sorted_tokens, number of tokens, [BLOCK_M] token ids) of one tile.

    Token ids past the tile's count are padding (0): masked by the caller.
    """
    return tile_rows(tiles_ptr, tile, BLOCK_M, BLOCK_M, SLOT_TILES)


@triton.jit
def tile_rows(tiles_ptr, tile, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, SLOT_TILES: tl.constexpr):
    """`tile_meta` with the first ROWS (<= BLOCK_M) token ids only: for steps whose tiles hold at most ROWS tokens."""
    return tile_tokens(tiles_ptr, tile, BLOCK_M, tl.arange(0, ROWS), SLOT_TILES)


@triton.jit
def tile_tokens(tiles_ptr, tile, BLOCK_M: tl.constexpr, offs_m, SLOT_TILES: tl.constexpr):
    """`tile_meta` with the token ids at positions offs_m (< BLOCK_M, repeats allowed) of the tile."""
    row = tiles_ptr + tile * (_HEAD + BLOCK_M)
    start = tl.load(row + 1)
    count = tl.load(row + 2)
    if SLOT_TILES:
        slot = tl.cast(tile, tl.int64)
    else:
        slot = tl.load(row)
    tok = tl.load(row + _HEAD + offs_m)
    return slot, start, count, tok


@triton.jit
def pick_slice(j, v0, v1, v2, NUM_S: tl.constexpr):
    """Slice j's value of a per-slice triple (scalars or pointers); slices past NUM_S are never picked."""
    v = v0
    if NUM_S > 1:
        v = tl.where(j == 1, v1, v)
    if NUM_S > 2:
        v = tl.where(j == 2, v2, v)
    return v


@triton.jit
def select_slice(pid_n, b0_ptr, b1_ptr, b2_ptr, col0, col1, col2, width0, width1, width2, y_off0, y_off1, y_off2,
                  first_nb1, first_nb2, NUM_S: tl.constexpr):
    """The slice column block pid_n belongs to (blocks run over the slices' widths laid end to end):

    (slice index, its B pool, its proj-table column, width, first column in y, block index within it).
    """
    j = 0
    if NUM_S > 1:
        j = tl.where(pid_n >= first_nb1, 1, j)
    if NUM_S > 2:
        j = tl.where(pid_n >= first_nb2, 2, j)
    nb = pid_n - pick_slice(j, 0, first_nb1, first_nb2, NUM_S)
    return (j, pick_slice(j, b0_ptr, b1_ptr, b2_ptr, NUM_S), pick_slice(j, col0, col1, col2, NUM_S),
            pick_slice(j, width0, width1, width2, NUM_S), pick_slice(j, y_off0, y_off1, y_off2, NUM_S), nb)


@triton.jit
def sum_splits(parts_ptr, rows, plane, split_k, mask, SPLIT: tl.constexpr):
    """sum over s < split_k of parts[s * plane + rows], masked, in split order (deterministic).

    rows: [BLOCK_M, BLOCK_R] offsets into one plane; all partials in one [SPLIT, BLOCK_M, BLOCK_R] load,
    through L2 only (.cg): they were written by other programs of this launch.
    """
    offs_s = tl.arange(0, SPLIT)
    ptrs = parts_ptr + offs_s[:, None, None] * plane + rows[None, :, :]
    parts = tl.load(ptrs, mask=(offs_s < split_k)[:, None, None] & mask[None, :, :], other=0.0, cache_modifier=".cg")
    return tl.sum(parts, axis=0)
