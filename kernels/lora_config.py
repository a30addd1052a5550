"""Launch parameters shared by the LoRA shrink and expand kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kubelora.kernels.lora import LoRAProj

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

    def __post_init__(self) -> None:
        for name in ("block_k", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"KernelConfig.{name}={value}: must be a power of two >= 16")
        if not 1 <= self.max_split <= MAX_SPLIT or self.target_programs < 1:
            raise ValueError(f"KernelConfig.max_split must be in 1..{MAX_SPLIT}, target_programs >= 1")


# Per tile height, from the variations timed on the H200 (docs/kernels.md, run 6): decode (16) splits
# in_dim because it has few tiles, but not so much that the split arrivals dominate (target 512, at most 8);
# taller tiles split less (the final sum holds split x height x 16 floats in registers). Expand warps: 8
# keeps a 16 x 256 y tile near 61 registers per thread; the prefill tile (64 x 256, 4 warps) spills a
# little but measured fastest (57.9 us against 64.1 for 64 x 128 with 8 warps).
DEFAULT_CONFIGS = {
    16: KernelConfig(target_programs=512, max_split=8, expand_warps=8),
    32: KernelConfig(max_split=8, block_n=128, expand_warps=8),
    64: KernelConfig(max_split=4, block_n=256, expand_warps=4),
}


def dot_precision(dtype: torch.dtype) -> str:
    # float32 pools stay exact (the CPU interpreter and fp32 engines); tf32 would cost 1e-3 relative error.
    return "ieee" if dtype == torch.float32 else "tf32"


def num_lanes(proj: LoRAProj, slices: list[int]) -> int:
    """Shrink output width: the largest rank among the slices, rounded up to BLOCK_R."""
    max_rank = max(proj.max_rank[s] for s in slices)
    return -(-max_rank // BLOCK_R) * BLOCK_R
