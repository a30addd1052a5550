"""`choose_config` pinned over a grid of steps: the launch choice as it was when its rules became a table.

`frozen_choice` is a literal copy of the rules as of commit cfb8ecc (before `kernels/lora_configs.json`), in
plain numbers: a change to the table or its reader that changes any step's launch fails here.
"""

from __future__ import annotations

import pytest

from kubelora.kernels.lora import TILE_HEIGHTS, prepare_lora_proj, prepare_lora_step
from kubelora.kernels.lora_config import DEFAULT_CONFIGS, EXPAND_RULES, SHRINK_RULES, KernelConfig, choose_config

FROZEN_HEIGHTS = {
    16: dict(target_programs=512, max_split=8, expand_warps=8, expand_stages=1, is_pdl=True, b_first=4,
             is_early_shrink=True, is_red_y=True),
    32: dict(max_split=8, block_n=128, expand_warps=8, is_pdl=True, b_first=1),
    64: dict(max_split=4, block_n=256, expand_warps=4),
}


def frozen_choice(block_m: int, num_tiles: int, max_tile_count: int, max_rank: int) -> dict:
    """The KernelConfig fields chosen for a step before the table (num_chunks: rank chunks of 16 lanes)."""
    config = dict(FROZEN_HEIGHTS[block_m])
    if block_m != 16:
        return config
    num_chunks = -(-max_rank // 16)
    is_full = max_tile_count == block_m
    if num_tiles >= 32 and max_tile_count <= 8 and (num_chunks == 1 or max_tile_count > 2):
        config.update(stack_tokens=8, block_n=512)
    if is_full and num_tiles >= 16:
        config.update(block_n=512, expand_warps=4)
    if max_tile_count == 1 and num_tiles < 32 or 2 < max_tile_count <= 8 and max_rank <= 8:
        return config | dict(gemv_rows=8, gemv_ranks=2, gemv_warps=8)
    if max_tile_count <= 2 and (num_chunks == 1 or num_tiles >= 32):
        if num_chunks > 1:
            config.update(expand_warps=4)
        return config | dict(gemv_rows=2)
    if num_chunks == 1 and num_tiles >= 32:
        return config | dict(is_per_slice=True, block_k=256)
    if num_chunks == 1 or num_tiles <= 8:
        config.update(is_per_slice=True, target_programs=1024)
        if is_full and num_chunks > 1:
            config.update(block_n=128, expand_warps=4)
        return config
    block_k = 256 if is_full else config.get("block_k", 128)
    return config | dict(max_split=4, is_per_slice=True, shrink_lanes=32, target_programs=1024, block_k=block_k)


NUM_TILES = (1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64)
TOKENS_PER_TILE = {16: (1, 2, 3, 4, 7, 8, 9, 15, 16), 32: (1, 2, 16, 32), 64: (1, 8, 64)}
# Per-slice ranks of every adapter; the step's slices are those of nonzero rank, as plan_groups passes them.
RANKS = ((8, 8, 8), (4, 0, 4), (16, 16, 16), (17, 17, 17), (32, 32, 32), (64, 64, 64), (8, 64, 16), (0, 48, 0))


@pytest.mark.parametrize("block_m", sorted(TOKENS_PER_TILE))
@pytest.mark.parametrize("ranks", RANKS)
def test_choose_config_is_unchanged_on_every_step(block_m, ranks):
    for num_tiles in NUM_TILES:
        for tokens in TOKENS_PER_TILE[block_m]:
            slots = [tile for tile in range(num_tiles) for _ in range(tokens)]
            step = prepare_lora_step(slots, num_tiles, "cpu", tile_heights=(block_m,))
            assert (step.block_m, step.num_tiles, step.max_tile_count) == (block_m, num_tiles, tokens)
            proj = prepare_lora_proj([[0] * 3] * num_tiles, [list(ranks)] * num_tiles, [[1.0] * 3] * num_tiles, "cpu")
            slices = [s for s, r in enumerate(ranks) if r]
            expected = frozen_choice(block_m, num_tiles, tokens, max(ranks))
            assert choose_config(step, proj, slices) == KernelConfig(**expected), (num_tiles, tokens)


def test_table_covers_every_tile_height_and_says_why():
    assert sorted(DEFAULT_CONFIGS) == list(TILE_HEIGHTS)
    for rule in EXPAND_RULES + SHRINK_RULES:
        assert rule.why and "\n" not in rule.why and rule.changes
