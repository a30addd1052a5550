"""LoRA step metadata, backend choice and the reference op, in plain PyTorch on CPU."""

from __future__ import annotations

import pytest
import torch

from kubelora.kernels.lora import (
    MAX_TILES,
    add_lora,
    add_lora_torch,
    default_backend,
    prepare_lora_proj,
    prepare_lora_projs,
    prepare_lora_step,
)
from lora_problems import DISTRIBUTIONS, build_problem, check_y


def test_step_groups_tokens_by_slot_in_tiles():
    step = prepare_lora_step([2, 0, -1, 2, 1, 0, 2, -1], 4, "cpu")
    assert step.has_lora and step.block_m == 16 and step.is_slot_tiles
    assert step.token_slots.tolist() == [2, 0, -1, 2, 1, 0, 2, -1]
    assert step.sorted_tokens.tolist() == [1, 5, 4, 0, 3, 6]
    # Slot tiles: row i is slot i, slot 3 (no tokens) included; then the tile's token ids, padded with 0.
    assert step.tiles.shape == (4, 3 + 16)
    expected = [[0, 0, 2, 1, 5, 0], [1, 2, 1, 4, 0, 0], [2, 3, 3, 0, 3, 6], [3, 6, 0, 0, 0, 0]]
    assert step.tiles[:, :6].tolist() == expected
    assert not step.tiles[:, 6:].any()


def test_long_segments_take_several_tiles():
    step = prepare_lora_step([1] * 150 + [0] * 20 + [-1] * 5, 2, "cpu", tile_heights=(64,))
    assert step.block_m == 64 and not step.is_slot_tiles
    assert step.tiles[:, :3].tolist() == [[0, 0, 20], [1, 20, 64], [1, 84, 64], [1, 148, 22]]
    assert step.sorted_tokens.tolist() == list(range(150, 170)) + list(range(150))
    assert step.tiles[1, 3:].tolist() == list(range(64))
    assert step.tiles[3, 3:].tolist() == list(range(128, 150)) + [0] * 42


@pytest.mark.parametrize(
    ("groups", "block_m"),
    [([16] * 40, 16), ([64], 16), ([512], 16), ([32] * 8, 16), ([20] * 64, 32), ([512] * 4, 64), ([2048], 64)],
)
def test_tile_height_keeps_the_tile_count_small(groups, block_m):
    slots = [slot for slot, n in enumerate(groups) for _ in range(n)]
    step = prepare_lora_step(slots, len(groups), "cpu")
    assert step.block_m == block_m
    assert step.num_tiles <= max(MAX_TILES, len(groups))


@pytest.mark.parametrize("slots", [[], [-1, -1], [0, -1]])
def test_steps_without_lora_tokens(slots):
    step = prepare_lora_step(slots, 1, "cpu")
    assert step.has_lora == (0 in slots)
    assert step.num_tiles == (1 if 0 in slots else 0)


def test_proj_max_rank_per_slice():
    proj = prepare_lora_proj([[0, 0], [3, 0]], [[3, 0], [12, 0]], [[1.0, 1.0], [0.5, 0.5]], "cpu")
    assert proj.max_rank == (12, 0)
    assert proj.rank.dtype == torch.int64 and proj.scale.dtype == torch.float32


def test_projs_of_several_kinds_share_one_buffer():
    """Every kind's tables are views of one packed buffer (one copy per step), with the values given."""
    tables = {
        "qkv": ([[0, 5, 9], [16, 21, 25]], [[5, 4, 0], [3, 3, 3]], [[0.5, 2.0, 1.0], [0.25, 0.25, 3.0]]),
        "o": ([[7], [2]], [[1], [9]], [[1.5], [0.125]]),
        "down": ([[0], [0]], [[0], [0]], [[0.0], [0.0]]),
    }
    projs = prepare_lora_projs(tables, "cpu")
    assert len({p.rank.untyped_storage().data_ptr() for p in projs.values()}) == 1
    for kind, (row_start, rank, scale) in tables.items():
        proj = projs[kind]
        assert proj.row_start.tolist() == row_start and proj.rank.tolist() == rank and proj.scale.tolist() == scale
        assert proj.scale.dtype == torch.float32 and proj.rank.stride() == (len(rank[0]), 1)
        assert proj.rank.data_ptr() % 16 == 0 and proj.scale.data_ptr() % 16 == 0  # Triton's pointer alignment
        assert proj.max_rank == prepare_lora_proj(row_start, rank, scale, "cpu").max_rank
    assert projs["down"].max_rank == (0,)


@pytest.mark.parametrize(("device", "expected"), [("cpu", "torch"), ("cuda", "triton"), ("cuda:1", "triton")])
def test_default_backend(device, expected):
    assert default_backend(device) == expected


@pytest.mark.parametrize(("value", "expected"), [("torch", "torch"), (" Triton ", "triton")])
def test_the_backend_is_named_at_the_entry_point(value, expected):
    from kubelora.engine.config import EngineConfig
    from kubelora.engine.server.config import engine_switches_from_env

    switches = engine_switches_from_env({"KUBELORA_LORA_BACKEND": value})
    assert switches == {"lora_backend": expected}
    assert EngineConfig(model_dir="m", **switches).lora_backend == expected
    with pytest.raises(ValueError, match="lora_backend must be 'torch', 'triton'"):
        EngineConfig(model_dir="m", **engine_switches_from_env({"KUBELORA_LORA_BACKEND": "cuda"}))


def test_add_lora_rejects_unknown_backend():
    p = build_problem(4, [[2]], [8], 8, "one", torch.float32, seed=0, device="cpu")
    with pytest.raises(ValueError, match="torch, triton"):
        add_lora(p.y0.clone(), p.x, p.lora_a, p.lora_b, p.proj, p.step, backend="cutlass")


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_reference_matches_float64(dist):
    ranks = [[3, 12, 0], [12, 1, 24], [24, 24, 24], [1, 0, 7]]
    p = build_problem(37, ranks, [24, 8, 16], 40, dist, torch.float32, seed=1, device="cpu", no_adapter=0.2)
    y = p.y0.clone()
    add_lora_torch(y, p.x, p.lora_a, p.lora_b, p.proj, p.step)
    check_y(p, y)


@pytest.mark.parametrize(("num_tokens", "num_adapters", "rank", "gemv_rows", "is_per_slice", "block_k", "target",
                          "max_split", "stack"), [
    (64, 8, 16, 0, True, 128, 1024, 8, 1),  # rank <= 16: one shrink program per slice
    (16, 1, 64, 0, True, 128, 1024, 8, 1),  # 1 tile x 4 chunks: up to 8 tiles at any rank too (full: 128-wide blocks)
    (256, 32, 16, 0, True, 256, 512, 8, 2),  # 32 tiles of rank <= 16: 256-wide in_dim steps; 8 tokens: 2 sub-blocks
    (256, 32, 8, 8, None, None, None, None, 2),  # 8 tokens per tile at rank <= 8: the wide GEMV shrink
    (64, 8, 8, 8, None, None, None, None, 1),  # the same on 8 tiles (no stacking)
    (1, 1, 64, 8, None, None, None, None, 1),  # one token per tile on few tiles, any rank: the wide GEMV shrink
    (256, 32, 64, 0, True, 128, 1024, 4, 2),  # 32 tiles x 4 chunks of 8 tokens: 32-lane shrink, stacked expand
    (256, 8, 64, 0, True, 256, 1024, 4, 1),  # 16 full tiles x 4 chunks: one program per slice of 32 lanes, <= 4
    # splits, 256-wide in_dim steps
    (256, 8, 16, 0, True, 128, 1024, 8, 1),  # 16 full tiles: 512-column expand blocks of 4 warps
    (64, 32, 8, 2, None, None, None, None, 8),  # 2 tokens per tile, one rank chunk: the GEMV shrink, 8 sub-blocks
    (64, 32, 64, 2, None, None, None, None, 1),  # 2 tokens per tile, 32 tiles: the GEMV shrink at any rank
    (16, 8, 64, 0, True, 128, 1024, 8, 1),  # 2 tokens per tile but 8 tiles of 4 chunks: the tensor-core shrink
])
def test_choose_config_by_step_size(num_tokens, num_adapters, rank, gemv_rows, is_per_slice, block_k, target,
                                    max_split, stack):
    from kubelora.kernels.lora_config import choose_config, stack_factor
    from kubelora.kernels.lora_shrink import uses_gemv

    slots = [i % num_adapters for i in range(num_tokens)]
    step = prepare_lora_step(slots, num_adapters, "cpu")
    ranks = [[rank] * 3 for _ in range(num_adapters)]
    rows = [[i * rank] * 3 for i in range(num_adapters)]
    proj = prepare_lora_proj(rows, ranks, [[1.0] * 3] * num_adapters, "cpu")
    config = choose_config(step, proj, [0, 1, 2])
    assert step.block_m == 16 and config.gemv_rows == gemv_rows and uses_gemv(step, config) == (gemv_rows > 0)
    if not gemv_rows:
        assert config.is_per_slice == is_per_slice and config.target_programs == target
        assert (config.block_k, config.max_split) == (block_k, max_split)
        assert config.shrink_lanes == (32 if rank > 16 and step.num_tiles > 8 else 16)
    is_full = step.max_tile_count == 16 and rank > 16 and step.num_tiles <= 8
    if gemv_rows == 8:
        assert (config.gemv_ranks, config.gemv_warps) == (2, 8)
    is_narrow = gemv_rows == 2 and rank > 16  # unstacked 2-token tiles at rank > 16: 4 expand warps
    is_wide = step.max_tile_count == 16 and step.num_tiles >= 16
    assert stack_factor(step, config) == stack and config.is_red_y
    assert (config.block_n, config.expand_warps) == ((128, 4) if is_full else (512, 8) if stack > 1 else
                                                     (512, 4) if is_wide else (256, 4) if is_narrow else (256, 8))


def test_repeat_launch_skips_the_jit_only_while_the_specialization_holds(monkeypatch):
    """Pure logic of RepeatLaunch with a stand-in kernel: direct launches while ints, dtypes and alignment hold."""
    from kubelora.kernels import lora_launch

    calls = []

    class Compiled:
        def __getitem__(self, grid):
            return lambda *args: calls.append(("direct", grid, args))

    class Fn:
        arg_names = ["x_ptr", "n", "BLOCK", "FLAG"]

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                calls.append(("jit", grid, args, kwargs))
                return Compiled()

            return run

    monkeypatch.setattr(lora_launch, "is_compiled", lambda kernel: isinstance(kernel, Compiled))
    launch = lora_launch.RepeatLaunch(Fn(), (4, 2), dict(BLOCK=16, FLAG=True, num_warps=4))
    base = torch.zeros(64)
    launch(base, 7)
    launch(base[4:], 7)  # 16-byte aligned view, same dtype: direct
    launch(base, 8)  # another integer: through the JIT again
    launch(base[1:], 8)  # 4-byte aligned: through the JIT again
    launch(base.double(), 8)  # another dtype: through the JIT again
    launch(base.double()[2:], 8)  # 16-byte aligned view of the same dtype: direct
    launch(8, base.double())  # the arguments' kinds swapped: through the JIT (which rejects it in real life)
    assert [c[0] for c in calls] == ["jit", "direct", "jit", "jit", "jit", "direct", "jit"]
    assert calls[0][3] == dict(BLOCK=16, FLAG=True, num_warps=4)
    assert calls[0][1] == (4, 2) and calls[1][1] == (4, 2, 1)  # a compiled kernel's launcher takes three dims
    assert calls[1][2][1:] == (7, 16, True)  # the constexprs passed in signature order
    shared = lora_launch.shared_launch(Fn, (4, 2), dict(BLOCK=16), key=(7,))
    assert lora_launch.shared_launch(Fn, (4, 2), dict(BLOCK=16), key=(7,)) is shared  # a later step: the same launch
    assert lora_launch.shared_launch(Fn, (4, 2), dict(BLOCK=16), key=(8,)) is not shared
    assert lora_launch.shared_launch(Fn, (4, 3), dict(BLOCK=16), key=(7,)) is not shared
    monkeypatch.setattr(lora_launch, "SHARED_LAUNCHES", 2)
    lora_launch.shared_launch(Fn, (5, 2), dict(BLOCK=16))  # a third since `shared`: the least recent goes
    assert lora_launch.shared_launch(Fn, (4, 2), dict(BLOCK=16), key=(7,)) is not shared
    launch(8, base.double()[2:])  # the swapped kinds again, aligned: direct
    launch(8, base.double()[1:])  # misaligned: the JIT, and a misaligned pointer is what it records
    launch(8, base.double()[3:])  # misaligned too: direct
    launch(8, base.double())  # aligned against a misaligned record: the JIT
    assert [c[0] for c in calls[-4:]] == ["direct", "jit", "direct", "jit"]


@pytest.mark.parametrize("slots", [[3, -1, 0, 3, 3, 1] * 40, [-1] * 7, [0] * 2048 + [1] * 2048])
def test_step_from_an_array_equals_the_step_from_a_list(slots):
    """The runner passes a prefill's token -> slot map as an int array (np.repeat over its chunks)."""
    import numpy as np

    a, b = prepare_lora_step(slots, 4, "cpu"), prepare_lora_step(np.array(slots), 4, "cpu")
    for name in ("token_slots", "sorted_tokens", "tiles"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    assert (a.block_m, a.is_slot_tiles, a.num_lora_tokens, a.max_tile_count) == (
        b.block_m, b.is_slot_tiles, b.num_lora_tokens, b.max_tile_count)
