"""Launch parameters of the LoRA kernels (shrink + expand) and which ones a step takes."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

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
# Its automatic rank rows per program: the most of 4, 2, 1 that still gives this many programs (4 rows measured
# fastest at 32 tiles, 1 row at 1 and 8 tiles).
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


CONFIGS_PATH = Path(__file__).with_name("lora_configs.json")
CONDITIONS = ("num_tiles", "max_tile_count", "num_chunks", "max_rank")


@dataclass(frozen=True)
class Rule:
    """One decode launch rule of the table: KernelConfig changes for the steps whose sizes meet `when`."""

    when: dict  # condition name -> (min, max), inclusive, None unbounded; or "is_full" -> bool
    changes: dict  # KernelConfig field -> value
    why: str

    def __post_init__(self) -> None:
        unknown = set(self.when) - {*CONDITIONS, "is_full"}
        if unknown:
            raise ValueError(f"lora_configs.json: unknown rule conditions {sorted(unknown)}: use {CONDITIONS}, is_full")
        KernelConfig(**self.changes)  # validates the field names and values

    def matches(self, sizes: dict) -> bool:
        return all(sizes[name] == bound if name == "is_full" else _within(sizes[name], *bound)
                   for name, bound in self.when.items())


def _within(value: int, low: int | None, high: int | None) -> bool:
    return (low is None or value >= low) and (high is None or value <= high)


def load_table(path: Path) -> tuple[dict[int, KernelConfig], list[Rule], list[Rule]]:
    """(config per tile height, decode expand rules, decode shrink rules) from the JSON table."""
    table = json.loads(path.read_text())
    heights = {int(h): KernelConfig(**entry["config"]) for h, entry in table["tile_heights"].items()}
    expand, shrink = ([Rule(r["when"], r["set"], r["why"]) for r in table[key]]
                      for key in ("decode_expand", "decode_shrink"))
    return heights, list(expand), list(shrink)


DEFAULT_CONFIGS, EXPAND_RULES, SHRINK_RULES = load_table(CONFIGS_PATH)


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


def step_sizes(step: LoRAStep, proj: LoRAProj, slices: list[int]) -> dict:
    """What the decode rules' conditions read: the step's tile counts and the slices' ranks."""
    return dict(num_tiles=step.num_tiles, max_tile_count=step.max_tile_count,
                num_chunks=num_lanes(proj, slices) // BLOCK_R, max_rank=max(proj.max_rank[s] for s in slices),
                is_full=step.max_tile_count == step.block_m)


def choose_config(step: LoRAStep, proj: LoRAProj, slices: list[int]) -> KernelConfig:
    """The launch configuration for one step and projection, from host-side sizes only (no device sync).

    Taller tiles take their height's config; decode steps (16-row tiles) take the first matching rule of
    `EXPAND_RULES` and of `SHRINK_RULES` on top of it (kernels/lora_configs.json).
    """
    config = DEFAULT_CONFIGS[step.block_m]
    if step.block_m != 16:
        return config
    sizes = step_sizes(step, proj, slices)
    changes = {}
    for rules in (EXPAND_RULES, SHRINK_RULES):
        changes.update(next((rule.changes for rule in rules if rule.matches(sizes)), {}))
    return replace(config, **changes)


def staged_expand_config(step: LoRAStep, proj: LoRAProj, slices: list[int]) -> KernelConfig:
    """The expand's config after a staged shrink (kernels/lora_triton.py: add_lora_staged_triton): the step's
    own, launched plainly (no programmatic dependent launch: behind cuBLAS it has no shrink to overlap, and the
    plain launch measured faster), and 1024-column blocks where column sub-blocks are stacked. On the H200 at
    batch 64 over 32 / 64 adapters (docs/benchmarks-engine.md, "The staged expand's launch") this took the q/k/v matmul + expand from 44.9 to
    41.5 us a layer and o's from 18.6 to 17.2 (64 adapters: 50.8 -> 46.4, 21.2 -> 20.0)."""
    config = replace(choose_config(step, proj, slices), is_pdl=False)
    if step.block_m == 16 and stack_factor(step, config) > 1:
        config = replace(config, block_n=max(config.block_n, 1024))
    return config


def step_config(step: LoRAStep, **changes) -> KernelConfig:
    """The default config of the step's tile height with KernelConfig changes (tests and the benchmark)."""
    return replace(DEFAULT_CONFIGS[step.block_m], **changes)
