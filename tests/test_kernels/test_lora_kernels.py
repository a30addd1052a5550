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
from lora_problems import build_problem, check_y

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
# (On CPU the programmatic dependent launches, PDL and the early shrink, are off whatever the config says.)
# Decode (16-row) tiles add into y by atomic adds by default: `red` covers taller tiles, `loaded-y` the other path.
LAUNCHES = {"auto": None, "split": {}, "slice": {"is_per_slice": True}, "gemv": {"gemv_rows": 8},
            "gemv-r1-k16": {"gemv_rows": 8, "gemv_ranks": 1, "gemv_k": 16}, "stack": {"stack_tokens": 8},
            "stack-n512-b1": {"stack_tokens": 8, "block_n": 512, "b_first": 1},
            "not-early": {"is_early_shrink": False}, "r64": {"shrink_lanes": 64},
            "slice-r32": {"shrink_lanes": 32, "is_per_slice": True}, "red": {"is_red_y": True},
            "loaded-y": {"is_red_y": False}, "stack-loaded-y": {"stack_tokens": 8, "is_red_y": False}}


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


def check_lanes_below_rank(p, t, ref, device) -> torch.Tensor:
    """t equals the reference on every lane below its token's rank, none of them left poisoned; returns that mask."""
    lane_rank = p.proj.rank[p.step.token_slots[p.step.sorted_tokens]]  # [num_lora_tokens, num_slices]
    valid = torch.arange(t.shape[2], device=device) < lane_rank[..., None]
    assert not t[valid].isnan().any()
    torch.testing.assert_close(t[valid], ref[valid], rtol=1e-5, atol=1e-4)
    return valid


@pytest.mark.parametrize("shrink_lanes", [16, 64])
@pytest.mark.parametrize("split_k", [1, 3, 32])
def test_shrink_writes_every_lane_below_rank(triton_backend, device, monkeypatch, split_k, shrink_lanes):
    from kubelora.kernels import lora_shrink

    poisoned = lambda *shape, device: torch.full(shape, math.nan, device=device)  # noqa: E731
    monkeypatch.setattr(lora_shrink, "new_workspace", poisoned)
    p = build_problem(30, ODD_RANKS, [24, 8, 8], 300, "zipf", torch.float32, seed=5, device=device, no_adapter=0.2)
    config = KernelConfig(block_k=16, shrink_lanes=shrink_lanes)
    slices = [0, 1, 2]
    x, lora_a = p.x.float(), [a.float() for a in p.lora_a]
    for config in (config, replace(config, is_per_slice=True)):  # each launch finds the counters reset
        t = lora_shrink.launch_shrink(x, lora_a, p.proj, p.step, slices, config, split_k)
        ref = lora_shrink.lora_shrink_torch(x, lora_a, p.proj, p.step, slices)
        assert t.shape == ref.shape and t.shape[2] % BLOCK_R == 0
        check_lanes_below_rank(p, t, ref, device)
    assert not lora_shrink.arrival_counters(torch.device(device), 1).any()


@pytest.mark.parametrize(("ranks_per_program", "block_k"), [(1, 16), (2, 4096), (4, 64), (0, 128)])
def test_gemv_shrink_writes_every_lane_below_rank(triton_backend, device, monkeypatch, ranks_per_program, block_k):
    from kubelora.kernels import lora_shrink

    poisoned = lambda *shape, device: torch.full(shape, math.nan, device=device)  # noqa: E731
    monkeypatch.setattr(lora_shrink, "new_workspace", poisoned)
    ranks = ODD_RANKS + [[40, 2, 7]]  # 40: rank groups past 16 lanes; several groups past the small ranks
    p = build_problem(12, ranks, [24, 8, 8], 300, "distinct", torch.float32, seed=5, device=device, no_adapter=0.2)
    config = KernelConfig(gemv_rows=4, gemv_ranks=ranks_per_program, gemv_k=block_k)
    slices = [0, 1, 2]
    assert lora_shrink.uses_gemv(p.step, config) and p.step.max_tile_count >= 2
    x, lora_a = p.x.float(), [a.float() for a in p.lora_a]
    t = lora_shrink.launch_shrink(x, lora_a, p.proj, p.step, slices, config)
    ref = lora_shrink.lora_shrink_torch(x, lora_a, p.proj, p.step, slices)
    assert t.shape == ref.shape
    valid = check_lanes_below_rank(p, t, ref, device)
    assert t[~valid].isnan().all()  # lanes past a rank: left as they were


def test_expand_matches_reference(triton_backend, device):
    from kubelora.kernels.lora_expand import launch_expand, lora_expand_torch

    p = build_problem(40, ODD_RANKS, [24, 8, 16], 8, "uniform", torch.float32, seed=6, device=device, no_adapter=0.2)
    t = torch.randn(p.step.sorted_tokens.numel(), 2, 32, device=device)
    y, y_ref = p.y0.clone(), p.y0.clone()
    args = ([p.lora_b[0], p.lora_b[2]], p.proj, p.step, [0, 2], [0, 32])
    launch_expand(y, t, *args, KernelConfig(block_n=16))
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


@pytest.mark.parametrize("block_n", [256, 512])
@pytest.mark.parametrize("tokens_per_slot", [1, 2, 3, 4, 5, 8])
def test_stacked_expand_every_factor(triton_backend, device, tokens_per_slot, block_n):
    """The expand with column sub-blocks stacked in its rows, at every factor (16 down to 2): widths that are no
    multiple of a sub-block, ranks past the chunks requested before t (the rank loop), slices of rank 0."""
    from kubelora.kernels.lora_config import stack_factor

    ranks = [[3, 0, 70], [16, 17, 1], [33, 8, 8]]
    slots = [a for _ in range(tokens_per_slot) for a in range(3)] + [-1]
    p = build_problem(len(slots), ranks, [40, 300, 24], 24, "one", torch.float32, seed=13, device=device)
    p.slots = slots
    p.step = prepare_lora_step(slots, len(ranks), device)
    config = step_config(p.step, stack_tokens=8, block_n=block_n, b_first=2)
    rows = 1 << (tokens_per_slot - 1).bit_length()
    assert stack_factor(p.step, config) == 16 // rows
    y = p.y0.clone()
    triton_backend.add_lora_triton(y, p.x, p.lora_a, p.lora_b, p.proj, p.step, config)
    check_y(p, y)


@pytest.mark.parametrize("changes", [{"shrink_lanes": 64}, {"shrink_lanes": 32, "is_per_slice": True}], ids=str)
def test_wide_shrink_chunks_past_the_lanes(triton_backend, device, changes):
    """Shrink programs of 32 or 64 rank lanes where t has 80 lanes: the last chunk's lanes past them are masked."""
    p = build_problem(40, [[70, 3, 65], [1, 64, 16], [33, 0, 8]], [24, 8, 16], 40, "uniform", torch.float32, seed=15,
                      device=device, no_adapter=0.1)
    y = p.y0.clone()
    triton_backend.add_lora_triton(y, p.x, p.lora_a, p.lora_b, p.proj, p.step, step_config(p.step, **changes))
    check_y(p, y)


@pytest.mark.gpu
@pytest.mark.parametrize("in_graph", [False, True])
@pytest.mark.parametrize("changes", [{}, {"gemv_rows": 8}, {"stack_tokens": 8}], ids=["split", "gemv", "stack"])
def test_early_shrink_waits_for_the_kernel_before(triton_backend, device, changes, in_graph):
    """A shrink launched early (programmatic dependent launch) and its expand see x and y as the kernel right before
    them wrote them (a 128 MB copy whose last elements are x and y, over NaN), eagerly and replayed in a graph."""
    p = build_problem(64, [[16, 16, 16]] * 32, [4096, 1024, 1024], 4096, "uniform", torch.bfloat16, seed=14,
                      device=device)
    config = step_config(p.step, is_early_shrink=True, **changes)
    assert config.is_pdl
    x_n, y_n = p.x.numel(), p.y0.numel()
    source = torch.randn(1 << 26, device=device, dtype=torch.bfloat16)
    source[-x_n - y_n : -y_n], source[-y_n:] = p.x.flatten(), p.y0.flatten()
    buffer = torch.empty_like(source)
    x, y = buffer[-x_n - y_n : -y_n].view_as(p.x), buffer[-y_n:].view_as(p.y0)

    def call():
        buffer.copy_(source)  # x and y are its last elements: written at the end of a 128 MB copy
        triton_backend.add_lora_triton(y, x, p.lora_a, p.lora_b, p.proj, p.step, config)

    call()  # eager (and the arrival counters allocated before any capture)
    check_y(p, y.clone())
    buffer.fill_(math.nan)
    if in_graph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        buffer.fill_(math.nan)
        graph.replay()
    else:
        call()
    torch.cuda.synchronize()
    check_y(p, y)


def test_pdl_only_where_it_can_run():
    from kubelora.kernels.lora_tile import uses_pdl

    assert not uses_pdl(True, torch.device("cpu"))
    assert not uses_pdl(False, torch.device("cuda", 0))


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
