"""Launch parameters of the LoRA kernels (shrink + expand) and which ones a step takes."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kubelora.kernels.lora import LoRAProj, LoRAStep

# Rank lanes per tl.dot: the instruction needs K and N >= 16. An adapter of rank r runs ceil(r / 16) chunks:
# its own rank rounded up to the tile, never the step's maximum rank.
BLOCK_R = 16
# Output slices fused into one launch pair (q/k/v); a projection with more runs several pairs.
MAX_SLICES = 3


def pad_slices(values: list) -> list:
    """Per-slice launch arguments (pools, columns, widths, offsets) padded to MAX_SLICES with the first slice's:
    the kernels take three of each and never pick the padding."""
    return values + values[:1] * (MAX_SLICES - len(values))

# K splits of the shrink: the last split adds all partials in one [split, tile, 16] register load.
MAX_SPLIT = 32
# The GEMV shrink (KernelConfig.gemv_rows) holds rows x (in_dim step / threads) inputs per thread in registers.
GEMV_MAX_ROWS = 8
# Its automatic rank rows per program: the most of 4, 2, 1 that still gives this many programs (run 23: 4 rows won
# at 32 tiles, 384 programs; 1 row at 1 and 8 tiles).
GEMV_PROGRAMS = 384


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and warps of one launch shape (chosen by the step's tile height, `LoRAStep.block_m`)."""

    block_k: int = 128  # shrink: in_dim columns per loop step
    shrink_warps: int = 4
    target_programs: int = 1024  # shrink: split in_dim until about this many programs run
    max_split: int = 16  # shrink: at most this many partial sums (times the tile height: registers)
    shrink_stages: int = 3  # software pipelining depth of the shrink's in_dim loop
    shrink_lanes: int = 16  # the tensor-core shrink's rank lanes per program (16, 32 or 64: x read once for them)
    block_n: int = 256  # expand: output columns per program
    expand_warps: int = 8
    expand_stages: int = 2  # the expand's rank loop is 1..8 steps: a shallow pipeline
    b_first: int = 0  # expand: rank chunks of B (0..4) requested before t (with PDL: while the shrink runs)
    is_folded: bool = True  # tile table with slot tiles and token ids (False: the v4 load chain)
    is_pdl: bool = False  # launch the expand early (Hopper programmatic dependent launch; CUDA only)
    # with is_pdl: launch the shrink early too, behind whatever kernel precedes it (it reads the step's metadata,
    # then waits for that kernel before reading x)
    is_early_shrink: bool = False
    is_per_slice: bool = False  # shrink: one program per slice (else all slices at once, x read once per split)
    # shrink: on steps whose tiles hold at most this many tokens (0: never), one program per (tile, slice, gemv_ranks
    # rank rows) over all of in_dim, with float32 products on CUDA cores: no tensor-core padding, no K split
    gemv_rows: int = 0
    gemv_ranks: int = 0  # rank rows per GEMV program (1, 2 or 4; 0: the most that keeps GEMV_PROGRAMS programs)
    gemv_k: int = 4096  # in_dim columns per GEMV loop step at most (a power of two)
    gemv_warps: int = 4
    # expand: on steps whose tiles hold at most this many tokens (0: never), the product's rows stack column
    # sub-blocks of the tile's tokens (`stack_factor`) instead of padding the tokens to the tile height
    stack_tokens: int = 0
    # expand: add the delta into y with atomic adds (done in L2, one per element: deterministic) instead of loading y
    # and storing the sum
    is_red_y: bool = False

    def __post_init__(self) -> None:
        for name in ("block_k", "block_n", "gemv_k", "shrink_lanes"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"KernelConfig.{name}={value}: must be a power of two >= 16")
        if self.gemv_ranks not in (0, 1, 2, 4) or not 0 <= self.gemv_rows <= GEMV_MAX_ROWS:
            raise ValueError(f"KernelConfig: gemv_ranks must be 0, 1, 2 or 4, gemv_rows in 0..{GEMV_MAX_ROWS}")
        if not 0 <= self.stack_tokens <= 8:
            raise ValueError(f"KernelConfig.stack_tokens={self.stack_tokens}: must be in 0..8")
        if not 0 <= self.b_first <= 4:
            raise ValueError(f"KernelConfig.b_first={self.b_first}: must be in 0..4")
        if not 1 <= self.max_split <= MAX_SPLIT or self.target_programs < 1:
            raise ValueError(f"KernelConfig.max_split must be in 1..{MAX_SPLIT}, target_programs >= 1")


# Per tile height, from the variations timed on the H200 (docs/kernels.md, run 6): decode (16) splits
# in_dim because it has few tiles, but not so much that the split arrivals dominate (target 512, at most 8);
# taller tiles split less (the final sum holds split x height x 16 floats in registers). Expand warps: 8
# keeps a 16 x 256 y tile near 61 registers per thread; the prefill tile (64 x 256, 4 warps) spills a
# little but measured fastest (57.9 us against 64.1 for 64 x 128 with 8 warps). PDL: 1..2 us off every
# decode shape (run 8); the prefill shape keeps plain launches (not measured with PDL). The decode shrink is launched
# early too, behind the kernel before it (run 42: 0.1..1.8 us off 29 of 31 decode shapes, 1x1x8 tied, 64x32x64 0.1 us
# slower: 64x1x64 10.2 -> 9.7, 256x8x16 15.2 -> 13.4, 16x8x16 6.8 -> 6.3). The decode expand adds into y by atomic
# adds (run 51: up to 1.0 us faster on 19 of 31 decode shapes, 0.1..0.2 us slower on 8 small ones: 64x32x36 23.1 ->
# 22.1, 256x32x16 17.7 -> 16.8, 256x8x64 21.7 -> 20.9, 1x1x8 4.0 -> 4.2; run 53: slower on prefill, 55.8 -> 59.0).
DEFAULT_CONFIGS = {
    16: KernelConfig(target_programs=512, max_split=8, expand_warps=8, expand_stages=1, is_pdl=True, b_first=4,
                     is_early_shrink=True, is_red_y=True),
    32: KernelConfig(max_split=8, block_n=128, expand_warps=8, is_pdl=True, b_first=1),
    64: KernelConfig(max_split=4, block_n=256, expand_warps=4),
}


def dot_precision(dtype: torch.dtype) -> str:
    # float32 pools stay exact (the CPU interpreter and fp32 engines); tf32 would cost 1e-3 relative error.
    return "ieee" if dtype == torch.float32 else "tf32"


def stack_factor(step: LoRAStep, config: KernelConfig) -> int:
    """Column sub-blocks the expand stacks in its product's rows (1: none, rows are the tile's tokens).

    A step of at most `config.stack_tokens` tokens per tile stacks block_m / R sub-blocks of R rows, R the tile's
    token count rounded up to a power of two, each at least 16 columns wide (tl.dot's N).
    """
    if not 0 < step.max_tile_count <= config.stack_tokens:
        return 1
    rows = 1 << (step.max_tile_count - 1).bit_length()
    return max(1, min(step.block_m // rows, config.block_n // 16))


def num_lanes(proj: LoRAProj, slices: list[int]) -> int:
    """Shrink output width: the largest rank among the slices, rounded up to BLOCK_R."""
    max_rank = max(proj.max_rank[s] for s in slices)
    return -(-max_rank // BLOCK_R) * BLOCK_R


# Decode steps (16-row tiles) by size, from the side-by-side variants of runs 19 and 20 (docs/kernels.md, v7): one
# shrink program per slice wins on every step of rank <= 16 and on steps of up to 8 tiles at any rank (by 1..3
# us), with up to 1024 programs, or with 256-wide in_dim steps from 32 tiles on; bigger steps of several rank
# chunks split in_dim at most 4 ways (run 12), one program per slice of 32 rank lanes since run 45 (v11). It also
# beat the signal path (the expand waiting on per-tile counters, v6) and the fused one-launch path (v5), since
# removed.
PER_SLICE_MAX_TILES = 8
WIDE_K_MIN_TILES = 32
# The GEMV shrink (v9, run 23) on decode steps of at most 2 tokens per tile, of one rank chunk or from 32 tiles on:
# 1x1x8 5.9 -> 4.2 us, 16x8x16 8.0 -> 7.1, 64x32x16 16.0 -> 15.1, 64x32 mixed ranks 30.0 -> 25.9 (4 warps); it lost
# on 16x8x64 (13.2 against 12.5) and on steps of 8 tokens per tile at rank >= 16 (8 rows of x re-read per program
# and multiplied on CUDA cores), and tied at rank 8.
GEMV_TILE_TOKENS = 2
# Steps of up to 8 full 16-token tiles at rank > 16 take 128-wide expand blocks of 4 warps: 64x1x64 10.5 -> 10.0,
# 10.2, 10.2 us in runs 22..24 (on steps of 2 or 8 tokens per tile they lost 0.8..1.7 us).


# The stacked expand (run 40/41, `stack_tokens`, 512 columns per program) on decode steps of at least 32 tiles of at
# most 8 tokens: 256x32x8 16.2 -> 15.3 us, 256x32x16 18.2 -> 17.7, 256x32x36 29.9 -> 28.4, 64x32x8 11.5 -> 10.2,
# 64x32x16 15.1 -> 14.8; not on 2-token tiles at rank > 16 (64x32x64 34.5 -> 39.2: t's stacked copies cost
# registers beside B's four chunks) nor on fewer tiles (16x8x64 12.3 -> 17.6, 1x1x64 6.7 -> 9.1).
STACK_TOKENS = 8
STACK_BLOCK_N = 512
# A wider GEMV shrink (8 warps, 2 rank rows per program) on steps of fewer than 32 one-token tiles (run 52:
# 1x1x64 6.6 -> 4.9 us, where the tensor-core shrink ran before; 1x1x16 4.2 -> 3.9, 1x1x8 tied) and on steps of
# 3..8-token tiles at rank <= 8 (runs 43, 50, 52: 256x32x8 15.3 -> 14.6, 15.2 -> 14.5, 14.9 -> 14.4; 64x8x8 tied; at
# rank 16 it lost: 256x32x16 17.1 -> 22.3).
WIDE_GEMV = dict(gemv_rows=8, gemv_ranks=2, gemv_warps=8)
WIDE_GEMV_MAX_RANK = 8
# Steps of at least 16 full 16-token tiles take 512-column expand blocks of 4 warps (run 54: 256x8x64 20.8 -> 19.4 us,
# 256x1x64 18.7 -> 17.5, 256x8x16 13.3 -> 12.6, 256x8x8 13.0 -> 12.4): 148 registers, 3 programs per multiprocessor
# (offline, sm_90), so 16 tiles x 24 blocks run in one wave, where 256-column blocks of 8 warps took 1.45.
WIDE_N_MIN_TILES = 16
WIDE_N = dict(block_n=512, expand_warps=4)


def choose_config(step: LoRAStep, proj: LoRAProj, slices: list[int]) -> KernelConfig:
    """The launch configuration for one step and projection, from host-side sizes only (no device sync).

    Decode steps of at most 2 tokens per tile, and of at most 8 at rank <= 8, run the GEMV shrink where it measured
    faster; other decode steps run one shrink program per slice (32 rank lanes wide on big steps of several rank
    chunks); decode steps of many small tiles stack the expand's column sub-blocks, those of many full tiles take wide
    expand blocks; taller tiles take their height's config.
    """
    config = DEFAULT_CONFIGS[step.block_m]
    if step.block_m != 16:
        return config
    num_chunks = num_lanes(proj, slices) // BLOCK_R
    max_rank = max(proj.max_rank[s] for s in slices)
    is_full = step.max_tile_count == step.block_m  # the largest tile fills all its rows
    if (step.num_tiles >= WIDE_K_MIN_TILES and step.max_tile_count <= STACK_TOKENS
            and (num_chunks == 1 or step.max_tile_count > GEMV_TILE_TOKENS)):
        config = replace(config, stack_tokens=STACK_TOKENS, block_n=STACK_BLOCK_N)
    if is_full and step.num_tiles >= WIDE_N_MIN_TILES:
        config = replace(config, **WIDE_N)
    if (step.max_tile_count == 1 and step.num_tiles < WIDE_K_MIN_TILES
            or GEMV_TILE_TOKENS < step.max_tile_count <= STACK_TOKENS and max_rank <= WIDE_GEMV_MAX_RANK):
        return replace(config, **WIDE_GEMV)
    if step.max_tile_count <= GEMV_TILE_TOKENS and (num_chunks == 1 or step.num_tiles >= WIDE_K_MIN_TILES):
        if num_chunks > 1:
            # Unstacked 2-token tiles at rank > 16 with the atomic adds into y: 4 expand warps (run 51: 64x32x64 33.4
            # -> 32.7, 64x32 mixed 24.8 -> 24.2, 64x32x36 22.1 -> 21.7 us).
            config = replace(config, expand_warps=4)
        return replace(config, gemv_rows=GEMV_TILE_TOKENS)
    if num_chunks == 1 and step.num_tiles >= WIDE_K_MIN_TILES:
        return replace(config, is_per_slice=True, block_k=256)
    if num_chunks == 1 or step.num_tiles <= PER_SLICE_MAX_TILES:
        config = replace(config, is_per_slice=True, target_programs=1024)
        if is_full and num_chunks > 1:
            return replace(config, block_n=128, expand_warps=4)  # full tiles at rank > 16 (runs 22..24)
        return config
    # Several rank chunks on more tiles: one program per slice and 32 rank lanes (run 45: 256x32 mixed 31.0 -> 28.6,
    # 256x32x36 28.3 -> 27.3, 256x32x64 38.1 -> 37.1, 256x1x64 20.4 -> 19.5, 256x8x64 22.1 -> 21.5; all slices per
    # program and 16 lanes before); on full tiles with 256-wide in_dim steps (run 56: 256x8x64 19.5 -> 18.9, 256x1x64
    # 17.6 -> 16.6 us; on 8-token tiles they lost: 256x32x64 36.5 -> 38.0).
    block_k = 256 if is_full else config.block_k
    return replace(config, max_split=4, is_per_slice=True, shrink_lanes=32, target_programs=1024, block_k=block_k)


def step_config(step: LoRAStep, **changes) -> KernelConfig:
    """The default config of the step's tile height with KernelConfig changes (tests and the benchmark)."""
    return replace(DEFAULT_CONFIGS[step.block_m], **changes)
