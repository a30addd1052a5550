"""Triton path of `add_lora`: per projection (per 3 slices), a shrink launch and an expand launch.

`shrink_lora_triton` and `expand_lora_triton` are its two halves, for callers that queue the shrink on a side
stream beside the base projection's matmul (engine/model/llama.py) and the expand after both."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kubelora.kernels.lora import LoRAProj, LoRAStep, prepare_lora_step
from kubelora.kernels.lora_config import MAX_SLICES, KernelConfig, choose_config
from kubelora.kernels.lora_expand import ExpandShape, _expand_kernel, launch_expand, plan_expand
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


def plan_groups(x: torch.Tensor, lora_b: list[torch.Tensor], proj: LoRAProj, step: LoRAStep,
                config: KernelConfig | None, is_pdl: bool = True) -> list[GroupLaunch]:
    """The step's launches for this projection, from sizes only (the same for every layer of the step).

    is_pdl False turns programmatic dependent launch off in the chosen configs (`shrink_lora_triton`)."""
    widths = [b.shape[1] for b in lora_b]
    offsets = [sum(widths[:s]) for s in range(len(widths))]
    active = [s for s, r in enumerate(proj.max_rank) if r > 0]
    groups = []
    for first in range(0, len(active), MAX_SLICES):
        slices = active[first : first + MAX_SLICES]
        group_config = config or choose_config(step, proj, slices)
        if not is_pdl and group_config.is_pdl:
            group_config = dataclasses.replace(group_config, is_pdl=False)
        y_offsets = [offsets[s] for s in slices]
        shrink = plan_shrink(x.shape[1], proj, step, slices, group_config, x.device, x.dtype)
        expand = plan_expand([widths[s] for s in slices], proj, step, slices, y_offsets, group_config, x.device,
                             lora_b[0].dtype)
        groups.append(GroupLaunch(slices, y_offsets, group_config, shrink, expand))
    return groups


def add_lora_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    proj: LoRAProj,
    step: LoRAStep,
    config: KernelConfig | None = None,
) -> None:
    """Triton: y[t, off_s:off_s+d_s] += scale[a,s] * (x[t] @ A_{a,s}^T) @ B_{a,s}^T with a = slot of t.

    Same arguments and semantics as `add_lora_torch`; slices of rank 0 everywhere are skipped entirely.
    config: the launch configuration (default: `choose_config` for the step); the benchmark and tests pass
    one to compare. The launch shapes of a step's own choice are computed by its first layer and kept in
    `proj.launch_cache`.
    """
    if not step.has_lora:
        return
    expand_lora_triton(y, shrink_lora_triton(x, lora_a, lora_b, proj, step, config), lora_b, proj, step)


@dataclass(frozen=True)
class Shrunk:
    """A projection's shrink outputs, one per launch group, waiting for their expands (`expand_lora_triton`)."""

    groups: list[GroupLaunch]
    t: list[torch.Tensor]
    step: LoRAStep


def shrink_lora_triton(
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    proj: LoRAProj,
    step: LoRAStep,
    config: KernelConfig | None = None,
    is_pdl: bool = True,
) -> Shrunk:
    """The first half of `add_lora_triton`: the shrink launches (x @ A^T per token), on the current stream.

    is_pdl False: no programmatic dependent launch for this projection (neither the shrink nor its expand is
    launched early), for a shrink queued on another stream than its expand, whose stream order PDL would not see.
    """
    if x.device.type != "cuda" and not is_interpreted():
        raise RuntimeError("the triton LoRA backend off CUDA needs TRITON_INTERPRET=1 before kubelora.kernels loads")
    step = with_tiles(step)
    if config is None:
        # Keyed by sizes; the step is kept and compared by identity (a proj may be paired with another step).
        key = (x.shape[1], x.dtype, x.device, tuple(b.shape[1] for b in lora_b), is_pdl)
        cached_step, groups = proj.launch_cache.get(key, (None, None))
        if cached_step is not step:
            groups = plan_groups(x, lora_b, proj, step, None, is_pdl)
            proj.launch_cache[key] = (step, groups)
    else:
        groups = plan_groups(x, lora_b, proj, step, config, is_pdl)
    t = [launch_shrink(x, [lora_a[s] for s in group.slices], proj, step, group.slices, group.config,
                       shape=group.shrink) for group in groups]
    return Shrunk(groups, t, step)


def expand_lora_triton(y: torch.Tensor, shrunk: Shrunk, lora_b: list[torch.Tensor], proj: LoRAProj,
                       step: LoRAStep) -> None:
    """The second half of `add_lora_triton`: y += t @ B^T per token, for the shrink outputs `shrunk`."""
    for group, t in zip(shrunk.groups, shrunk.t):
        launch_expand(y, t, [lora_b[s] for s in group.slices], proj, shrunk.step, group.slices, group.y_offsets,
                      group.config, shape=group.expand)
