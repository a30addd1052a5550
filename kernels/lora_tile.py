"""Device side of the per-step tile table (`LoRAStep.tiles`), shared by the LoRA kernels.

A program's first loads are its tile row and its slot's (rank, first row, scale). With slot tiles (tile i
is slot i) and the tile's token ids folded into its row, both are one round trip, issued together, before
any data is read; the v4 chain (tile row -> slot's rank / token ids -> data) is kept behind
`is_folded=False` for measurement.
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
def tile_meta(tiles_ptr, sorted_ptr, tile, BLOCK_M: tl.constexpr, SLOT_TILES: tl.constexpr, FOLDED: tl.constexpr):
    """(slot, start in sorted_tokens, number of tokens, [BLOCK_M] token ids) of one tile.

    Token ids past the tile's count are padding (0): masked by the caller.
    """
    row = tiles_ptr + tile * (_HEAD + BLOCK_M)
    offs_m = tl.arange(0, BLOCK_M)
    start = tl.load(row + 1)
    count = tl.load(row + 2)
    if FOLDED:
        if SLOT_TILES:
            slot = tile.to(tl.int64)
        else:
            slot = tl.load(row)
        tok = tl.load(row + _HEAD + offs_m)
    else:
        slot = tl.load(row)
        tok = tl.load(sorted_ptr + start + offs_m, mask=offs_m < count, other=0)
    return slot, start, count, tok
