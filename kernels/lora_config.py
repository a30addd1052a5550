"""Launch parameters of the LoRA kernels (shrink + expand, or the fused launch) and which one a step takes."""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

import torch

from kubelora.kernels.lora import LoRAProj, LoRAStep

# Rank lanes per tl.dot: the instruction needs K and N >= 16. An adapter of rank r runs ceil(r / 16) chunks:
# its own rank rounded up to the tile, never the step's maximum rank.
BLOCK_R = 16
# Output slices fused into one launch pair (q/k/v); a projection with more runs several pairs.
MAX_SLICES = 3
# K splits of the shrink: the last split adds all partials in one [split, tile, 16] register load.
MAX_SPLIT = 32


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and warps of one launch shape (chosen by the step's tile height, `LoRAStep.block_m`)."""

    block_k: int = 128  # shrink: in_dim columns per loop step
    shrink_warps: int = 4
    target_programs: int = 1024  # shrink: split in_dim until about this many programs run
    max_split: int = 16  # shrink: at most this many partial sums (times the tile height: registers)
    shrink_stages: int = 3  # software pipelining depth of the shrink's in_dim loop
    block_n: int = 256  # expand: output columns per program
    expand_warps: int = 8
    expand_stages: int = 2  # the expand's rank loop is 1..8 steps: a shallow pipeline
    b_first: int = 0  # expand: rank chunks of B (0..4) requested before t (with PDL: while the shrink runs)
    is_folded: bool = True  # tile table with slot tiles and token ids (False: the v4 load chain)
    is_pdl: bool = False  # launch the expand early (Hopper programmatic dependent launch; CUDA only)
    is_per_slice: bool = False  # shrink: one program per slice (else all slices at once, x read once per split)

    def __post_init__(self) -> None:
        for name in ("block_k", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"KernelConfig.{name}={value}: must be a power of two >= 16")
        if not 0 <= self.b_first <= 4:
            raise ValueError(f"KernelConfig.b_first={self.b_first}: must be in 0..4")
        if not 1 <= self.max_split <= MAX_SPLIT or self.target_programs < 1:
            raise ValueError(f"KernelConfig.max_split must be in 1..{MAX_SPLIT}, target_programs >= 1")


@dataclass(frozen=True)
class FusedConfig:
    """Tile sizes of the fused launch."""

    block_n: int = 256  # output columns per block (a program runs SUB blocks of one slice)
    block_k: int = 256  # in_dim columns per shrink loop step
    warps: int = 4
    wide_warps: int = 8  # from 64 lanes on: the B block held through the shrink loop needs more threads
    stages: int = 3  # software pipelining of the shrink loop
    target_programs: int = 128  # more blocks per program while over this many programs (each re-reads A)
    is_folded: bool = True  # tile table with slot tiles and token ids (False: the v4 load chain)

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"FusedConfig.{name}={value}: must be a power of two >= 16")
        if self.target_programs < 1:
            raise ValueError(f"FusedConfig.target_programs={self.target_programs}: must be >= 1")


# Per tile height, from the variations timed on the H200 (docs/kernels.md, run 6): decode (16) splits
# in_dim because it has few tiles, but not so much that the split arrivals dominate (target 512, at most 8);
# taller tiles split less (the final sum holds split x height x 16 floats in registers). Expand warps: 8
# keeps a 16 x 256 y tile near 61 registers per thread; the prefill tile (64 x 256, 4 warps) spills a
# little but measured fastest (57.9 us against 64.1 for 64 x 128 with 8 warps). PDL: 1..2 us off every
# decode shape (run 8); the prefill shape keeps plain launches (not measured with PDL).
DEFAULT_CONFIGS = {
    16: KernelConfig(target_programs=512, max_split=8, expand_warps=8, expand_stages=1, is_pdl=True, b_first=4),
    32: KernelConfig(max_split=8, block_n=128, expand_warps=8, is_pdl=True, b_first=1),
    64: KernelConfig(max_split=4, block_n=256, expand_warps=4),
}


def dot_precision(dtype: torch.dtype) -> str:
    # float32 pools stay exact (the CPU interpreter and fp32 engines); tf32 would cost 1e-3 relative error.
    return "ieee" if dtype == torch.float32 else "tf32"


def num_lanes(proj: LoRAProj, slices: list[int]) -> int:
    """Shrink output width: the largest rank among the slices, rounded up to BLOCK_R."""
    max_rank = max(proj.max_rank[s] for s in slices)
    return -(-max_rank // BLOCK_R) * BLOCK_R


class LoRAPath(enum.Enum):
    """How one projection call runs (per group of up to MAX_SLICES slices)."""

    SPLIT = "split"  # shrink (in_dim split, last arrival sums) then expand: two launches
    # Two launches; the expand starts each tile once its (tile, rank chunk) arrival counters are complete and
    # sums the shrink's partials itself: no t, no wait for the whole shrink grid (docs/kernels.md, v6).
    SIGNAL = "signal"
    FUSED = "fused"  # one launch: each column program recomputes its tile's shrink


@dataclass(frozen=True)
class LaunchPlan:
    path: LoRAPath
    split: KernelConfig
    fused: FusedConfig


DEFAULT_FUSED = FusedConfig()


# Decode steps (16-row tiles) by size, from the side-by-side variants of run 19 (docs/kernels.md, v7): one shrink
# program per slice wins on every step of rank <= 16 and on steps of up to 8 tiles at any rank (by 1..3 us), with
# up to 1024 programs, or with 256-wide in_dim steps from 32 tiles on; bigger steps of several rank chunks keep
# all slices in one program and split in_dim at most 4 ways (run 12). The signal path won the small steps in v6;
# one program per slice beats it there too.
PER_SLICE_MAX_TILES = 8
WIDE_K_MIN_TILES = 32


def choose_plan(step: LoRAStep, proj: LoRAProj, slices: list[int]) -> LaunchPlan:
    """The launch for one step and projection, from host-side sizes only (no device sync).

    Decode steps take the split path with one shrink program per slice unless they are big and of several
    rank chunks; taller tiles the split path with the tile height's config. The fused launch measured slower on every decode shape (run 8, docs/kernels.md
    v5: its in_dim loop is one program's chain of dependent loads), so only a plan that asks for it gets it.
    """
    config = DEFAULT_CONFIGS[step.block_m]
    if step.block_m != 16:
        return LaunchPlan(LoRAPath.SPLIT, config, DEFAULT_FUSED)
    num_chunks = num_lanes(proj, slices) // BLOCK_R
    if num_chunks == 1 and step.num_tiles >= WIDE_K_MIN_TILES:
        return LaunchPlan(LoRAPath.SPLIT, replace(config, is_per_slice=True, block_k=256), DEFAULT_FUSED)
    if num_chunks == 1 or step.num_tiles <= PER_SLICE_MAX_TILES:
        return LaunchPlan(LoRAPath.SPLIT, replace(config, is_per_slice=True, target_programs=1024), DEFAULT_FUSED)
    return LaunchPlan(LoRAPath.SPLIT, replace(config, max_split=4), DEFAULT_FUSED)


def forced_plan(step: LoRAStep, path: LoRAPath, *, is_folded: bool = True, is_pdl: bool | None = None,
                is_per_slice: bool | None = None) -> LaunchPlan:
    """The default configs of the step's tile height on a given path (tests and the benchmark compare paths).

    is_pdl, is_per_slice None keep the default config's.
    """
    split = DEFAULT_CONFIGS[step.block_m]
    split = replace(split, is_folded=is_folded, is_pdl=split.is_pdl if is_pdl is None else is_pdl,
                    is_per_slice=split.is_per_slice if is_per_slice is None else is_per_slice)
    return LaunchPlan(path, split, replace(DEFAULT_FUSED, is_folded=is_folded))
