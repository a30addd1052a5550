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


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and warps of one launch shape (chosen by the step's tile height, `LoRAStep.block_m`)."""

    block_k: int = 128  # shrink: in_dim columns per loop step
    shrink_warps: int = 4
    target_programs: int = 1024  # shrink: split in_dim until about this many programs run
    max_split: int = 16  # shrink: at most this many partial sums for the expand to add
    block_n: int = 256  # expand: output columns per program
    expand_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_k", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"KernelConfig.{name}={value}: must be a power of two >= 16")
        if self.max_split < 1 or self.target_programs < 1:
            raise ValueError("KernelConfig.max_split and target_programs must be >= 1")


# Per tile height: decode (16) splits in_dim widely because it has few tiles; prefill (64) has many tiles,
# and every extra split is one more partial sum that each expand program re-reads.
DEFAULT_CONFIGS = {
    16: KernelConfig(),
    32: KernelConfig(max_split=8),
    64: KernelConfig(max_split=4, block_n=128),
}


def dot_precision(dtype: torch.dtype) -> str:
    # float32 pools stay exact (the CPU interpreter and fp32 engines); tf32 would cost 1e-3 relative error.
    return "ieee" if dtype == torch.float32 else "tf32"


def num_lanes(proj: LoRAProj, slices: list[int]) -> int:
    """Shrink output width: the largest rank among the slices, rounded up to BLOCK_R."""
    max_rank = max(proj.max_rank[s] for s in slices)
    return -(-max_rank // BLOCK_R) * BLOCK_R
