"""Launch variants timed side by side on the benchmark's shapes (`kubelora bench kernels --compare/--tune`).

For choosing the defaults in `kernels/lora_config.py` and `kernels/lora.py`; docs/kernels.md logs the results.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kubelora.kernels import bench_lora
from kubelora.kernels.bench_baselines import BenchSet, torch_reference
from kubelora.kernels.bench_lora import Shape, check_ours, ours, shape_sets, time_graph
from kubelora.kernels.lora import LoRAStep, prepare_lora_step
from kubelora.kernels.lora_config import KernelConfig, LaunchPlan, LoRAPath, choose_plan, forced_plan


def _forced(path: LoRAPath, is_pdl: bool = True, **changes):
    """A plan on path (PDL on unless told) with KernelConfig changes."""

    def plan_for(step: LoRAStep) -> LaunchPlan:
        plan = forced_plan(step, path, is_pdl=is_pdl)
        return replace(plan, split=replace(plan.split, **changes))

    return plan_for


# label -> (prepare_lora_step keyword changes, the plan for the step; None: the step's own choice).
# s1: expand_stages=1. Run 8 timed v4's tile policy and table and fused with target_programs 64 / 256 and
# block_k 128; run 9 split+pdl with max_split 16 / 32 and fused with 512 / 1024-wide in_dim steps; runs 10..12
# the signal path with and without PDL, with pipelined expands and 16 splits, fused, b_first 1, 512-wide
# signal steps, 32-row tiles; run 17 a persistent launch; runs 19..20 one shrink program per slice (docs/kernels.md,
# v7).
PATH_VARIANTS = {
    "split+pdl s1": ({}, _forced(LoRAPath.SPLIT, expand_stages=1)),
    "signal+pdl k256 s1": ({}, _forced(LoRAPath.SIGNAL, block_k=256, expand_stages=1)),
    "slice s1": ({}, _forced(LoRAPath.SPLIT, is_pdl=False, expand_stages=1, is_per_slice=True)),
    "slice pdl s1": ({}, _forced(LoRAPath.SPLIT, expand_stages=1, is_per_slice=True)),
    "slice pdl k256": ({}, _forced(LoRAPath.SPLIT, block_k=256, expand_stages=1, is_per_slice=True)),
    "slice pdl t1024": ({}, _forced(LoRAPath.SPLIT, target_programs=1024, expand_stages=1, is_per_slice=True)),
    "slice pdl t1024 split16": ({}, _forced(LoRAPath.SPLIT, target_programs=1024, max_split=16, expand_stages=1,
                                            is_per_slice=True)),
    "slice pdl t2048 split16": ({}, _forced(LoRAPath.SPLIT, target_programs=2048, max_split=16, expand_stages=1,
                                            is_per_slice=True)),
    "slice pdl k256 t1024": ({}, _forced(LoRAPath.SPLIT, block_k=256, target_programs=1024, expand_stages=1,
                                         is_per_slice=True)),
    "slice pdl t1024 n128": ({}, _forced(LoRAPath.SPLIT, target_programs=1024, block_n=128, expand_stages=1,
                                         is_per_slice=True)),
    "slice pdl t1024 n512": ({}, _forced(LoRAPath.SPLIT, target_programs=1024, block_n=512, expand_stages=1,
                                         is_per_slice=True)),
    "slice pdl t1024 w4": ({}, _forced(LoRAPath.SPLIT, target_programs=1024, expand_warps=4, expand_stages=1,
                                       is_per_slice=True)),
    "slice pdl t1024 b2": ({}, _forced(LoRAPath.SPLIT, target_programs=1024, b_first=2, expand_stages=1,
                                       is_per_slice=True)),
    "auto": ({}, None),
}
PDL_VARIANTS = {label for label in PATH_VARIANTS if "pdl" in label}  # only with --pdl


def _with_step(sets: list[BenchSet], shape: Shape, step_changes: dict) -> LoRAStep:
    step = prepare_lora_step(list(shape.slots), len(shape.ranks), bench_lora.DEVICE, **step_changes)
    for st in sets:
        st.step = step
    return step


def probe_pdl() -> None:
    """Exit non-zero unless a split launch with programmatic dependent launch is right eagerly and in a CUDA graph.

    Run in its own process first: a failed launch may leave the CUDA context unusable.
    """
    shape = Shape("probe", tuple(i % 4 for i in range(16)), (16,) * 4)
    _, sets = shape_sets(shape, torch.bfloat16)
    plan = forced_plan(sets[0].step, LoRAPath.SPLIT, is_pdl=True)
    eager_error = check_ours(sets, plan)
    st = sets[0]
    fresh_y = st.y.clone()
    ours(plan)(st)  # first call outside the graph: allocates the arrival counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ours(plan)(st)
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


def compare_paths(shapes: list[Shape], dtype: torch.dtype, with_pdl: bool) -> list[str]:
    """Us per call of each PATH_VARIANTS entry, one line per shape; a variant off the reference is marked BAD."""
    lines = []
    for shape in shapes:
        _, sets = shape_sets(shape, dtype)
        default_step = sets[0].step
        fresh_y = sets[0].y.clone()  # the check's delta is taken on a fresh y, not one grown by the replays
        times = {}
        for label, (step_changes, plan_for) in PATH_VARIANTS.items():
            if label in PDL_VARIANTS and not with_pdl:
                continue
            try:
                step = _with_step(sets, shape, step_changes)
                plan = None if plan_for is None else plan_for(step)
                sets[0].y.copy_(fresh_y)
                if check_ours(sets, plan) > 2e-2:
                    label += " BAD"
                times[label] = time_graph(ours(plan), sets, trials=5)
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
    from kubelora.kernels.lora_expand import lora_expand
    from kubelora.kernels.lora_shrink import lora_shrink

    widths = bench_lora.WIDTHS
    slices = list(range(len(widths)))
    offsets = [sum(widths[:s]) for s in slices]
    shrink_out = {id(st): lora_shrink(st.x, st.lora_a, st.proj, st.step, slices, config) for st in sets}
    return {
        "shrink only": time_graph(lambda st: lora_shrink(st.x, st.lora_a, st.proj, st.step, slices, config), sets),
        "expand only": time_graph(
            lambda st: lora_expand(st.y, shrink_out[id(st)], st.lora_b, st.proj, st.step, slices, offsets, config),
            sets),
    }


# label -> (KernelConfig changes, tile heights the step may choose from; None: the default policy).
# Run 6 timed the v3 configs' variations (block_k 64, stages, target 2048, ...: docs/kernels.md).
TUNE_VARIANTS = {
    "tiles=16,32": ({}, (16, 32)),
    "k128": (dict(block_k=128), None), "k256": (dict(block_k=256), None),
    "split4": (dict(max_split=4), None), "split16": (dict(max_split=16, target_programs=1024), None),
    "target1024": (dict(target_programs=1024), None),
    "shrink w2": (dict(shrink_warps=2), None), "shrink w8": (dict(shrink_warps=8), None),
    "shrink s2": (dict(shrink_stages=2), None),
    "n128": (dict(block_n=128), None), "n512": (dict(block_n=512), None),
    "w4": (dict(expand_warps=4), None), "n128 w4": (dict(block_n=128, expand_warps=4), None),
    "b1": (dict(b_first=1), None), "b2": (dict(b_first=2), None),
}


def tune(shapes: list[Shape], dtype: torch.dtype) -> list[str]:
    """Time one-at-a-time variations of each shape's own launch (path and config from choose_plan)."""
    lines = []
    for shape in shapes:
        _, sets = shape_sets(shape, dtype)
        step = sets[0].step
        slices = list(range(len(bench_lora.WIDTHS)))
        base = choose_plan(step, sets[0].proj, slices)
        times = {f"auto ({base.path.value} k{base.split.block_k} split{base.split.max_split})":
                 time_graph(ours(base), sets)}
        times.update(split_times(sets, base.split))
        for label, (change, heights) in TUNE_VARIANTS.items():
            try:
                variant_step = _with_step(sets, shape, {} if heights is None else dict(tile_heights=heights))
                plan = choose_plan(variant_step, sets[0].proj, slices)
                times[label] = time_graph(ours(replace(plan, split=replace(plan.split, **change))), sets)
            except Exception as err:  # a variant that does not compile (e.g. out of shared memory) is skipped
                print(f"  {label}: {str(err).splitlines()[0][:120]}")
        _with_step(sets, shape, {})
        lines.append(f"{shape.name} (tile {step.block_m}): " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))
        print(lines[-1], flush=True)
        del sets
        torch.cuda.empty_cache()
    return lines
