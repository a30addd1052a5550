"""Launch variants timed side by side on the benchmark's shapes (`kubelora bench kernels --compare/--tune`).

For choosing the launch table (`kernels/lora_configs.json`) and the tile heights (`kernels/lora.py`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kubelora.bench import kernels as bench_kernels
from kubelora.bench.baselines import BenchSet, torch_reference
from kubelora.bench.kernels import Shape, check_ours, ours, shape_sets, time_graph
from kubelora.kernels.lora import LoRAStep, prepare_lora_step
from kubelora.kernels.lora_config import KernelConfig, choose_config, step_config


def _auto(**changes):
    # The step's own choice (choose_config) with KernelConfig changes.
    return lambda step, proj: replace(choose_config(step, proj, list(range(len(bench_kernels.WIDTHS)))), **changes)


def _height(**changes):
    # The tile height's default config with KernelConfig changes.
    return lambda step, proj: step_config(step, **changes)


# label -> (prepare_lora_step keyword changes, config for (step, proj); None: the step's own choice through
# add_lora's cache). s1: expand_stages=1 (the decode default); slice: one shrink program per slice;
# t1024: up to 1024 shrink programs; gemvN: the GEMV shrink on steps of at most N tokens per tile (rN: N rank
# rows per program, wN: N warps); n128 w4: 128-wide expand blocks, 4 expand warps. Variants that lost on every
# shape are removed (git log has them).
PATH_VARIANTS = {
    "split s1": ({}, _height(is_pdl=False)),
    "slice s1": ({}, _height(is_pdl=False, is_per_slice=True)),
    "pdl s1 split4": ({}, _height(max_split=4)),
    "slice pdl t1024": ({}, _height(target_programs=1024, is_per_slice=True)),
    "auto": ({}, None),
    "auto pdl n128 w4": ({}, _auto(block_n=128, expand_warps=4)),
    "auto pdl n256 w8": ({}, _auto(block_n=256, expand_warps=8)),
    "no gemv": ({}, _auto(gemv_rows=0)),
    "gemv2": ({}, _auto(gemv_rows=2)),
    "gemv2 w8": ({}, _auto(gemv_rows=2, gemv_warps=8)),
    "gemv2 r1": ({}, _auto(gemv_rows=2, gemv_ranks=1)),
    "gemv2 n128 w4": ({}, _auto(gemv_rows=2, block_n=128, expand_warps=4)),
    "gemv8 r2 w8 n128 w4": ({}, _auto(gemv_rows=8, gemv_ranks=2, gemv_warps=8, block_n=128, expand_warps=4)),
    # stack: the expand stacks column sub-blocks in its rows on steps of <= 8 tokens per tile (nN: N columns per
    # program, w4: 4 warps)
    "stack": ({}, _auto(stack_tokens=8)),
    "stack w4": ({}, _auto(stack_tokens=8, expand_warps=4)),
    "stack n512": ({}, _auto(stack_tokens=8, block_n=512)),
    "stack n512 w4": ({}, _auto(stack_tokens=8, block_n=512, expand_warps=4)),
    "stack n1024": ({}, _auto(stack_tokens=8, block_n=1024)),
    # no early: the shrink not launched early
    "no early": ({}, _auto(is_early_shrink=False)),
    "gemv8 r2 w8": ({}, _auto(gemv_rows=8, gemv_ranks=2, gemv_warps=8)),
    # rN: the tensor-core shrink with N rank lanes per program (x read once for them); slice: one slice per program
    "r32": ({}, _auto(shrink_lanes=32)),
    "r64": ({}, _auto(shrink_lanes=64)),
    "slice r64": ({}, _auto(shrink_lanes=64, is_per_slice=True)),
    "slice r64 split16": ({}, _auto(shrink_lanes=64, is_per_slice=True, max_split=16, target_programs=1024)),
    "slice r32 t1024": ({}, _auto(shrink_lanes=32, is_per_slice=True, target_programs=1024)),
    "slice r64 w8": ({}, _auto(shrink_lanes=64, is_per_slice=True, shrink_warps=8)),
    # no red: the decode expand loads y and stores the sum instead of atomic adds into y; wN: N expand warps; nN: N
    # columns per expand program
    "no red": ({}, _auto(is_red_y=False)),
    "w4": ({}, _auto(expand_warps=4)),
    "w8": ({}, _auto(expand_warps=8)),
    "n512 w4": ({}, _auto(block_n=512, expand_warps=4)),
    "n256 w8": ({}, _auto(block_n=256, expand_warps=8)),
    # k256: 256-wide in_dim steps in the tensor-core shrink
    "k256": ({}, _auto(block_k=256)),
}
PDL_VARIANTS = {label for label in PATH_VARIANTS if "pdl" in label}  # only with --pdl


def _with_step(sets: list[BenchSet], shape: Shape, step_changes: dict) -> LoRAStep:
    step = prepare_lora_step(list(shape.slots), len(shape.ranks), bench_kernels.DEVICE, **step_changes)
    for st in sets:
        st.step = step
    return step


def probe_pdl() -> None:
    """Exit non-zero unless a split launch with programmatic dependent launch is right eagerly and in a CUDA graph.

    Run in its own process first: a failed launch may leave the CUDA context unusable.
    """
    shape = Shape("probe", tuple(i % 4 for i in range(16)), (16,) * 4)
    _, sets = shape_sets(shape, torch.bfloat16)
    config = step_config(sets[0].step, is_pdl=True)
    eager_error = check_ours(sets, config)
    st = sets[0]
    fresh_y = st.y.clone()
    ours(config)(st)  # first call outside the graph: allocates the arrival counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ours(config)(st)
    st.y.copy_(fresh_y)
    graph.replay()
    graph_delta = st.y.float() - fresh_y.float()
    st.y.copy_(fresh_y)
    torch_reference(st)
    ref = st.y.float() - fresh_y.float()
    graph_error = float((graph_delta - ref).norm() / ref.norm())
    torch.cuda.synchronize()
    print(f"PDL probe: rel err eager {eager_error:.1e}, in a CUDA graph {graph_error:.1e}")
    raise SystemExit(0 if max(eager_error, graph_error) < 2e-2 else 1)


def compare_paths(shapes: list[Shape], dtype: torch.dtype, with_pdl: bool,
                  labels: list[str] | None = None) -> list[str]:
    """Us per call of each PATH_VARIANTS entry (or of those labels), one line per shape; a variant off the
    reference is marked BAD."""
    unknown = set(labels or ()) - set(PATH_VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants: {', '.join(sorted(unknown))}")
    lines = []
    for shape in shapes:
        _, sets = shape_sets(shape, dtype)
        default_step = sets[0].step
        fresh_y = sets[0].y.clone()  # the check's delta is taken on a fresh y, not one grown by the replays
        times = {}
        for label, (step_changes, config_for) in PATH_VARIANTS.items():
            if label in PDL_VARIANTS and not with_pdl or labels is not None and label not in labels:
                continue
            try:
                step = _with_step(sets, shape, step_changes)
                config = None if config_for is None else config_for(step, sets[0].proj)
                sets[0].y.copy_(fresh_y)
                if check_ours(sets, config) > 2e-2:
                    label += " BAD"
                times[label] = time_graph(ours(config), sets, trials=5)
            except Exception as err:  # a variant that fails (compile, capture) is reported, the others still run
                print(f"  {shape.name} {label}: {type(err).__name__}: {str(err).splitlines()[0][:160]}", flush=True)
        timings = ", ".join(f"{k} {v:.1f}" for k, v in times.items())
        lines.append(f"{shape.name} (tile {default_step.block_m}): {timings}")
        print(lines[-1], flush=True)
        del sets
        torch.cuda.empty_cache()
    return lines


def split_times(sets: list[BenchSet], config: KernelConfig) -> dict[str, float]:
    """The shrink and the expand timed alone (the expand on shrink outputs computed beforehand)."""
    from kubelora.kernels.lora_expand import launch_expand
    from kubelora.kernels.lora_shrink import launch_shrink

    widths = bench_kernels.WIDTHS
    slices = list(range(len(widths)))
    offsets = [sum(widths[:s]) for s in slices]
    shrink_out = {id(st): launch_shrink(st.x, st.lora_a, st.proj, st.step, slices, config) for st in sets}
    return {
        "shrink only": time_graph(lambda st: launch_shrink(st.x, st.lora_a, st.proj, st.step, slices, config), sets),
        "expand only": time_graph(
            lambda st: launch_expand(st.y, shrink_out[id(st)], st.lora_b, st.proj, st.step, slices, offsets, config),
            sets),
    }


# label -> (KernelConfig changes, tile heights the step may choose from; None: the default policy).
TUNE_VARIANTS = {
    "tiles=16,32": ({}, (16, 32)),
    "k128": (dict(block_k=128), None), "k256": (dict(block_k=256), None),
    "split4": (dict(max_split=4), None), "split16": (dict(max_split=16, target_programs=1024), None),
    "target1024": (dict(target_programs=1024), None),
    "shrink w2": (dict(shrink_warps=2), None), "shrink w8": (dict(shrink_warps=8), None),
    "shrink s2": (dict(shrink_stages=2), None),
    "gemv2": (dict(gemv_rows=2), None), "gemv4": (dict(gemv_rows=4), None),
    "n128": (dict(block_n=128), None), "n512": (dict(block_n=512), None),
    "w4": (dict(expand_warps=4), None), "n128 w4": (dict(block_n=128, expand_warps=4), None),
    "b1": (dict(b_first=1), None), "b2": (dict(b_first=2), None),
}


def tune(shapes: list[Shape], dtype: torch.dtype) -> list[str]:
    """Time one-at-a-time variations of each shape's own launch (its config from choose_config)."""
    lines = []
    for shape in shapes:
        _, sets = shape_sets(shape, dtype)
        step = sets[0].step
        slices = list(range(len(bench_kernels.WIDTHS)))
        base = choose_config(step, sets[0].proj, slices)
        label = f"auto ({'slice ' if base.is_per_slice else ''}k{base.block_k} split{base.max_split})"
        times = {label: time_graph(ours(base), sets)}
        times.update(split_times(sets, base))
        for label, (change, heights) in TUNE_VARIANTS.items():
            try:
                variant_step = _with_step(sets, shape, {} if heights is None else dict(tile_heights=heights))
                config = choose_config(variant_step, sets[0].proj, slices)
                times[label] = time_graph(ours(replace(config, **change)), sets)
            except Exception as err:  # a variant that does not compile (e.g. out of shared memory) is skipped
                print(f"  {label}: {str(err).splitlines()[0][:120]}")
        _with_step(sets, shape, {})
        lines.append(f"{shape.name} (tile {step.block_m}): " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))
        print(lines[-1], flush=True)
        del sets
        torch.cuda.empty_cache()
    return lines
