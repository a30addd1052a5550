"""Triton LoRA kernels against their PyTorch references, at small sizes.

On CPU they run under TRITON_INTERPRET=1 (fp32 and fp16: the interpreter has returned garbage for tl.dot on
bf16 operands); on a GPU, in fp16 and bf16. The full GPU sweep is test_lora_sweep.py.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from kubelora.kernels.lora import LoRAStep, add_lora, prepare_lora_step
from kubelora.kernels.lora_config import BLOCK_R, DEFAULT_CONFIGS, KernelConfig, step_config
from kubelora.kernels.lora_problems import build_problem, check_y

DTYPES = (torch.float16, torch.bfloat16) if torch.cuda.is_available() else (torch.float32, torch.float16)
ODD_RANKS = [[3, 3, 0], [12, 12, 12], [24, 5, 24], [1, 0, 17]]

# (num_tokens, ranks per adapter and slice, slice widths, in_dim, distribution, share of tokens without adapter)
CASES = [
    (1, [[8, 8, 8]], [24, 8, 8], 40, "one", 0.0),
    (13, ODD_RANKS, [24, 8, 8], 40, "uniform", 0.25),
    (20, ODD_RANKS, [40, 12, 12], 72, "distinct", 0.0),
    (50, [[2, 2]] * 8 + [[33, 40]] * 3, [20, 20], 33, "zipf", 0.1),
    (90, ODD_RANKS, [17, 9, 9], 130, "segments", 0.0),
    (70, [[16]] * 5, [50], 24, "segments", 0.3),
    (6, [[1, 1, 1]] * 6, [7, 5, 3], 16, "distinct", 0.0),
]


# Launches: the step's own choice (add_lora), or the tile height's default config with these changes.
# "prefetch": the shrink asks the expand's B and y rows into L2 (on CUDA; elsewhere the plain shrink runs);
# "blocks": several expand column blocks per program (the last program's blocks run past the last slice);
# "narrow": the shrink over the tiles' tokens only, without tensor cores (where tiles hold at most 8 tokens).
LAUNCHES = {"auto": None, "split": {}, "slice": {"is_per_slice": True},
            "prefetch": {"is_per_slice": True, "l2_prefetch": 2}, "blocks": {"expand_blocks": 4, "block_n": 16},
            "narrow": {"is_narrow_shrink": True}, "narrow-slice": {"is_narrow_shrink": True, "is_per_slice": True}}


def run_path(triton_backend, p, path: str, **changes) -> torch.Tensor:
    y = p.y0.clone()
    if LAUNCHES[path] is None:
        add_lora(y, p.x, p.lora_a, p.lora_b, p.proj, p.step, backend="triton")
    else:
        config = step_config(p.step, **LAUNCHES[path], **changes)
        triton_backend.add_lora_triton(y, p.x, p.lora_a, p.lora_b, p.proj, p.step, config)
    return y


@pytest.mark.parametrize("path", LAUNCHES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}tok-{len(c[1])}ad-{c[4]}")
def test_add_lora_matches_float64(triton_backend, device, dtype, case, path):
    num_tokens, ranks, widths, in_dim, dist, no_adapter = case
    p = build_problem(num_tokens, ranks, widths, in_dim, dist, dtype, seed=num_tokens, device=device,
                      no_adapter=no_adapter)
    check_y(p, run_path(triton_backend, p, path))


@pytest.mark.parametrize("path", ["split", "slice"])
@pytest.mark.parametrize("case", [CASES[1], CASES[4]], ids=lambda c: f"{c[0]}tok-{c[4]}")
def test_unfolded_tile_table_reads(triton_backend, device, case, path):
    num_tokens, ranks, widths, in_dim, dist, no_adapter = case
    p = build_problem(num_tokens, ranks, widths, in_dim, dist, torch.float32, seed=3, device=device,
                      no_adapter=no_adapter)
    check_y(p, run_path(triton_backend, p, path, is_folded=False))


@pytest.mark.parametrize("split_k", [1, 3, 32])
def test_shrink_writes_every_lane_below_rank(triton_backend, device, monkeypatch, split_k):
    from kubelora.kernels import lora_shrink

    poisoned = lambda *shape, device: torch.full(shape, math.nan, device=device)  # noqa: E731
    monkeypatch.setattr(lora_shrink, "new_workspace", poisoned)
    p = build_problem(30, ODD_RANKS, [24, 8, 8], 300, "zipf", torch.float32, seed=5, device=device, no_adapter=0.2)
    config = KernelConfig(block_k=16)
    slices = [0, 1, 2]
    x, lora_a = p.x.float(), [a.float() for a in p.lora_a]
    for config in (config, replace(config, is_per_slice=True)):  # each launch finds the counters reset
        t = lora_shrink.lora_shrink(x, lora_a, p.proj, p.step, slices, config, split_k)
        ref = lora_shrink.lora_shrink_torch(x, lora_a, p.proj, p.step, slices)
        assert t.shape == ref.shape and t.shape[2] % BLOCK_R == 0
        lane_rank = p.proj.rank[p.step.token_slots[p.step.sorted_tokens]]  # [num_lora_tokens, num_slices]
        valid = torch.arange(t.shape[2], device=device) < lane_rank[..., None]
        assert not t[valid].isnan().any()
        torch.testing.assert_close(t[valid], ref[valid], rtol=1e-5, atol=1e-4)
    assert not lora_shrink.arrival_counters(torch.device(device), 1).any()


@pytest.mark.parametrize("blocks", [1, 2, 4])
def test_expand_matches_reference(triton_backend, device, blocks):
    """Blocks of a program may straddle two slices, and run past the last one (3 blocks of 16 columns here)."""
    from kubelora.kernels.lora_expand import lora_expand, lora_expand_torch

    p = build_problem(40, ODD_RANKS, [24, 8, 16], 8, "uniform", torch.float32, seed=6, device=device, no_adapter=0.2)
    t = torch.randn(p.step.sorted_tokens.numel(), 2, 32, device=device)
    y, y_ref = p.y0.clone(), p.y0.clone()
    args = ([p.lora_b[0], p.lora_b[2]], p.proj, p.step, [0, 2], [0, 32])
    lora_expand(y, t, *args, KernelConfig(block_n=16, expand_blocks=blocks))
    lora_expand_torch(y_ref, t, *args)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-4)


def test_more_slices_than_one_launch_fuses(triton_backend, device):
    ranks = [[4, 0, 9, 2, 16], [0, 0, 3, 3, 3]]  # slice 1: rank 0 everywhere, skipped
    p = build_problem(11, ranks, [8, 8, 16, 24, 8], 20, "uniform", torch.float32, seed=7, device=device)
    y = p.y0.clone()
    add_lora(y, p.x, p.lora_a, p.lora_b, p.proj, p.step, backend="triton")
    check_y(p, y)


def test_hand_made_step_without_tiles(triton_backend, device):
    p = build_problem(9, ODD_RANKS, [24, 8, 8], 40, "uniform", torch.float32, seed=8, device=device, no_adapter=0.3)
    bare = LoRAStep(token_slots=p.step.token_slots, num_slots=p.step.num_slots, has_lora=p.step.has_lora)
    y = p.y0.clone()
    add_lora(y, p.x, p.lora_a, p.lora_b, p.proj, bare, backend="triton")
    check_y(p, y)


def test_no_lora_tokens_leave_y_alone(triton_backend, device):
    p = build_problem(5, ODD_RANKS, [24, 8, 8], 40, "uniform", torch.float32, seed=9, device=device)
    step = prepare_lora_step([-1] * 5, len(ODD_RANKS), device)
    y = p.y0.clone()
    add_lora(y, p.x, p.lora_a, p.lora_b, p.proj, step, backend="triton")
    assert torch.equal(y, p.y0)


@pytest.mark.parametrize("path", LAUNCHES)
@pytest.mark.parametrize("block_m", sorted(DEFAULT_CONFIGS))
@pytest.mark.parametrize("tokens_per_slot", [5, 30, 100])
def test_every_tile_height(triton_backend, device, block_m, tokens_per_slot, path):
    slots = [a for a in range(3) for _ in range(tokens_per_slot)] + [-1]
    p = build_problem(len(slots), ODD_RANKS, [24, 8, 8], 40, "one", torch.float32, seed=10, device=device)
    p.slots = slots
    p.step = prepare_lora_step(slots, 4, device, tile_heights=(block_m,))  # slot 3: no tokens, an empty tile
    assert p.step.block_m == block_m and p.step.is_slot_tiles == (tokens_per_slot <= block_m)
    check_y(p, run_path(triton_backend, p, path))


def test_pdl_only_where_it_can_run():
    from kubelora.kernels.lora_tile import uses_pdl

    assert not uses_pdl(True, torch.device("cpu"))
    assert not uses_pdl(False, torch.device("cuda", 0))


def test_l2_prefetch_only_where_it_can_run(device):
    """The prefetch is planned on Hopper only; the interpreter (no inline PTX) runs the plain shrink."""
    from kubelora.kernels.lora_shrink import ExpandTarget, plan_shrink

    p = build_problem(13, ODD_RANKS, [24, 8, 8], 40, "uniform", torch.float32, seed=3, device=device)
    slices = [0, 1, 2]
    config = step_config(p.step, l2_prefetch=2)
    target = ExpandTarget([24, 8, 8], [0, 24, 32], torch.float32)
    shape = plan_shrink(40, p.proj, p.step, slices, config, torch.device(device), torch.float32, expand=target)
    is_hopper = device == "cuda" and torch.cuda.get_device_capability()[0] >= 9
    assert shape.is_prefetching == is_hopper
    assert not plan_shrink(40, p.proj, p.step, slices, config, torch.device(device), torch.float32).is_prefetching
    with pytest.raises(ValueError, match="l2_prefetch"):
        KernelConfig(l2_prefetch=3)
    with pytest.raises(ValueError, match="expand_blocks"):
        KernelConfig(expand_blocks=3)


@pytest.mark.parametrize(("slots", "rows"), [([0, 1, 0, 2], 2), ([0, 0, 0, 1], 4), ([0] * 5 + [1], 16), ([1], 1),
                                             ([0] * 40, 16)])
def test_narrow_shrink_rows(device, slots, rows):
    """The narrow shrink takes the most tokens of a tile, rounded up to a power of two, up to 4; else the tile."""
    from kubelora.kernels.lora_shrink import plan_shrink

    p = build_problem(len(slots), [[8]] * 3, [16], 32, "uniform", torch.float32, seed=4, device=device)
    step = prepare_lora_step(slots, 3, device)
    config = step_config(step, is_narrow_shrink=True)
    shape = plan_shrink(32, p.proj, step, [0], config, torch.device(device), torch.float32)
    assert shape.launch.constexprs["ROWS"] == rows
    assert step.max_tile_count == min(max(slots.count(s) for s in set(slots)), step.block_m)


@pytest.mark.parametrize(("block_m", "blocks"), [(16, 4), (32, 4), (64, 1)])
def test_expand_blocks_on_decode_tiles_only(device, block_m, blocks):
    """Several column blocks per program where a block is 16 or 32 rows; 64-row tiles keep one (registers)."""
    from kubelora.kernels.lora_expand import plan_expand

    p = build_problem(40, [[8, 8]] * 2, [24, 40], 16, "uniform", torch.float32, seed=2, device=device)
    step = prepare_lora_step([0] * 40, 2, device, tile_heights=(block_m,))
    config = KernelConfig(block_n=16, expand_blocks=4)
    shape = plan_expand([24, 40], p.proj, step, [0, 1], [0, 24], config, torch.device(device), torch.float32)
    assert shape.launch.constexprs["BLOCKS"] == blocks
    assert shape.launch.grid == (-(-5 // blocks), step.num_tiles)  # 2 + 3 column blocks of 16


def test_launch_shapes_are_planned_once_per_step(triton_backend, device, monkeypatch):
    """Layers of one step reuse the first layer's launch shapes; a new step with the same proj plans again."""
    p = build_problem(13, ODD_RANKS, [24, 8, 8], 40, "uniform", torch.float32, seed=12, device=device)
    real = triton_backend.plan_groups
    calls = []
    monkeypatch.setattr(triton_backend, "plan_groups", lambda *args: calls.append(1) or real(*args))
    for _ in range(3):
        check_y(p, run_path(triton_backend, p, "auto"))
    assert len(calls) == 1
    p.step = prepare_lora_step(p.slots, p.step.num_slots, device)
    check_y(p, run_path(triton_backend, p, "auto"))
    assert len(calls) == 2
