"""Triton path of `add_lora`: per projection (per 3 slices), one fused launch or a shrink + expand pair."""

from __future__ import annotations

import torch

from kubelora.kernels.lora import LoRAProj, LoRAStep, prepare_lora_step
from kubelora.kernels.lora_config import MAX_SLICES, LaunchPlan, LoRAPath, choose_plan
from kubelora.kernels.lora_expand import _expand_kernel, launch_expand
from kubelora.kernels.lora_fused import lora_fused
from kubelora.kernels.lora_shrink import launch_shrink


def is_interpreted() -> bool:
    """True when the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return type(_expand_kernel).__name__ == "InterpretedFunction"


def with_tiles(step: LoRAStep) -> LoRAStep:
    """A step built by hand (no tile table) rebuilt through prepare_lora_step; costs a device sync."""
    if step.tiles is not None:
        return step
    return prepare_lora_step(step.token_slots.tolist(), step.num_slots, step.token_slots.device)


def add_lora_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    proj: LoRAProj,
    step: LoRAStep,
    plan: LaunchPlan | None = None,
) -> None:
    """Triton: y[t, off_s:off_s+d_s] += scale[a,s] * (x[t] @ A_{a,s}^T) @ B_{a,s}^T with a = slot of t.

    Same arguments and semantics as `add_lora_torch`; slices of rank 0 everywhere are skipped entirely.
    plan: the launch (default: `choose_plan` for the step); the benchmark and tests pass one to compare.
    """
    if not step.has_lora:
        return
    if x.device.type != "cuda" and not is_interpreted():
        raise RuntimeError("the triton LoRA backend off CUDA needs TRITON_INTERPRET=1 before kubelora.kernels loads")
    step = with_tiles(step)
    widths = [b.shape[1] for b in lora_b]
    offsets = [sum(widths[:s]) for s in range(len(widths))]
    active = [s for s, r in enumerate(proj.max_rank) if r > 0]
    for first in range(0, len(active), MAX_SLICES):
        group = active[first : first + MAX_SLICES]
        group_plan = plan or choose_plan(step, proj, group)
        a_group, b_group = [lora_a[s] for s in group], [lora_b[s] for s in group]
        y_offsets = [offsets[s] for s in group]
        if group_plan.path is LoRAPath.FUSED:
            lora_fused(y, x, a_group, b_group, proj, step, group, y_offsets, group_plan.fused)
        else:
            is_signal = group_plan.path is LoRAPath.SIGNAL
            shrunk = launch_shrink(x, a_group, proj, step, group, group_plan.split, is_signal=is_signal)
            launch_expand(y, shrunk, b_group, proj, step, group, y_offsets, group_plan.split)
