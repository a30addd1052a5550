"""Triton path of `add_lora`: per projection (per 3 slices), a shrink launch and an expand launch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kubelora.kernels.lora import LoRAProj, LoRAStep, prepare_lora_step
from kubelora.kernels.lora_config import MAX_SLICES, KernelConfig, choose_config, staged_expand_config
from kubelora.kernels.lora_expand import ExpandShape, _expand_kernel, launch_expand, launch_expand_staged, plan_expand
from kubelora.kernels.lora_shrink import ShrinkShape, launch_shrink, plan_shrink


def is_interpreted() -> bool:
    """True when the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return type(_expand_kernel).__name__ == "InterpretedFunction"


def with_tiles(step: LoRAStep) -> LoRAStep:
    """A step built by hand (no tile table) rebuilt through prepare_lora_step; costs a device sync."""
    if step.tiles is not None:
        return step
    return prepare_lora_step(step.token_slots.tolist(), step.num_slots, step.token_slots.device)


@dataclass(frozen=True)
class GroupLaunch:
    """One launch pair of a step's projection: up to MAX_SLICES slices, their config and host-side launch shapes."""

    slices: list[int]
    y_offsets: list[int]
    config: KernelConfig
    shrink: ShrinkShape
    expand: ExpandShape


def slice_groups(lora_b: list[torch.Tensor], proj: LoRAProj) -> list[tuple[list[int], list[int], list[int]]]:
    """The projection's adapted slices (rank > 0 somewhere in the step) in launches of up to MAX_SLICES: per
    launch (slices, their first columns in y, their widths)."""
    widths = [b.shape[1] for b in lora_b]
    offsets = [sum(widths[:s]) for s in range(len(widths))]
    active = [s for s, r in enumerate(proj.max_rank) if r > 0]
    return [(slices, [offsets[s] for s in slices], [widths[s] for s in slices])
            for slices in (active[first : first + MAX_SLICES] for first in range(0, len(active), MAX_SLICES))]


def plan_groups(x: torch.Tensor, lora_b: list[torch.Tensor], proj: LoRAProj, step: LoRAStep,
                config: KernelConfig | None, has_bias: bool = False) -> list[GroupLaunch]:
    """The step's launches for this projection, from sizes only (the same for every layer of the step)."""
    groups = []
    for slices, y_offsets, widths in slice_groups(lora_b, proj):
        group_config = config or choose_config(step, proj, slices)
        shrink = plan_shrink(x.shape[1], proj, step, slices, group_config, x.device, x.dtype)
        expand = plan_expand(widths, proj, step, slices, y_offsets, group_config, x.device, lora_b[0].dtype,
                             has_bias=has_bias)
        groups.append(GroupLaunch(slices, y_offsets, group_config, shrink, expand))
    return groups


def step_groups(x: torch.Tensor, lora_b: list[torch.Tensor], proj: LoRAProj, step: LoRAStep,
                has_bias: bool = False) -> list[GroupLaunch]:
    """`plan_groups` with the step's own configs, planned by the step's first layer and kept in `proj.launch_cache`
    (keyed by sizes; the step is kept and compared by identity: a proj may be paired with another step)."""
    key = (x.shape[1], x.dtype, x.device, tuple(b.shape[1] for b in lora_b), has_bias)
    cached_step, groups = proj.launch_cache.get(key, (None, None))
    if cached_step is not step:
        groups = plan_groups(x, lora_b, proj, step, None, has_bias)
        proj.launch_cache[key] = (step, groups)
    return groups


def add_lora_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    proj: LoRAProj,
    step: LoRAStep,
    config: KernelConfig | None = None,
    bias: torch.Tensor | None = None,
) -> None:
    """Triton: y[t, off_s:off_s+d_s] += scale[a,s] * (x[t] @ A_{a,s}^T) @ B_{a,s}^T with a = slot of t.

    Same arguments and semantics as `add_lora_torch` (DoRA's scale, with its bias, in the expand launch's store);
    slices of rank 0 everywhere are skipped entirely.
    config: the launch configuration (default: `choose_config` for the step); the benchmark and tests pass
    one to compare. The launch shapes of a step's own choice are computed by its first layer and kept in
    `proj.launch_cache`.
    """
    if not step.has_lora:
        return
    if x.device.type != "cuda" and not is_interpreted():
        raise RuntimeError("the triton LoRA backend off CUDA needs TRITON_INTERPRET=1 before kubelora.kernels loads")
    step = with_tiles(step)
    has_bias = bias is not None
    groups = (step_groups(x, lora_b, proj, step, has_bias) if config is None
              else plan_groups(x, lora_b, proj, step, config, has_bias))
    for group in groups:
        a_group, b_group = [lora_a[s] for s in group.slices], [lora_b[s] for s in group.slices]
        t = launch_shrink(x, a_group, proj, step, group.slices, group.config, shape=group.shrink)
        launch_expand(y, t, b_group, proj, step, group.slices, group.y_offsets, group.config, shape=group.expand,
                      bias=bias)


def add_lora_staged_triton(y: torch.Tensor, width: int, lora_b: list[torch.Tensor], proj: LoRAProj,
                           step: LoRAStep, config: KernelConfig | None = None,
                           bias: torch.Tensor | None = None) -> None:
    """The expand half of `add_lora_triton` for a staged shrink: y[:, :width] += each token's delta.

    y: [num_tokens, width + staged rows], computed as x @ [W; A_staged]^T by one matmul whose weight rows past
    `width` hold the step's adapters' A rows (engine/adapters/staging.py): its columns past `width` are the
    shrink rows, at proj.t_col[slot, slice]. One expand launch per group of slices, as `add_lora_triton`'s, with
    `staged_expand_config` (config: another one, for the benchmark and tests); no shrink launch. bias: the
    projection's [width], for DoRA's scale (`launch_expand`).
    """
    if not step.has_lora:
        return
    assert step.tiles is not None and proj.t_col is not None
    key = ("staged", width, y.dtype, y.device, tuple(b.shape[1] for b in lora_b), config, bias is not None)
    cached_step, groups = proj.launch_cache.get(key, (None, None))
    if cached_step is not step:
        groups = []
        for slices, y_offsets, widths in slice_groups(lora_b, proj):
            group_config = config or staged_expand_config(step, proj, slices)
            shape = plan_expand(widths, proj, step, slices, y_offsets, group_config, y.device, lora_b[0].dtype,
                                is_t_in_y=True, has_bias=bias is not None)
            groups.append((slices, y_offsets, shape))
        proj.launch_cache[key] = (step, groups)
    for slices, y_offsets, shape in groups:
        launch_expand_staged(y, width, [lora_b[s] for s in slices], proj, step, slices, y_offsets, shape, bias=bias)
