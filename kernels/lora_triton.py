"""Triton path of `add_lora`: one shrink launch and one expand launch per projection (per 3 slices)."""

from __future__ import annotations

import torch

from kubelora.kernels.lora import LoRAProj, LoRAStep, prepare_lora_step
from kubelora.kernels.lora_config import DEFAULT_CONFIGS, MAX_SLICES, KernelConfig
from kubelora.kernels.lora_expand import _expand_kernel, lora_expand
from kubelora.kernels.lora_shrink import lora_shrink


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
    config: KernelConfig | None = None,
) -> None:
    """Triton: y[t, off_s:off_s+d_s] += scale[a,s] * (x[t] @ A_{a,s}^T) @ B_{a,s}^T with a = slot of t.

    Same arguments and semantics as `add_lora_torch`; slices of rank 0 everywhere are skipped entirely.
    """
    if not step.has_lora:
        return
    if x.device.type != "cuda" and not is_interpreted():
        raise RuntimeError("the triton LoRA backend off CUDA needs TRITON_INTERPRET=1 before kubelora.kernels loads")
    step = with_tiles(step)
    config = config or DEFAULT_CONFIGS[step.block_m]
    widths = [b.shape[1] for b in lora_b]
    offsets = [sum(widths[:s]) for s in range(len(widths))]
    active = [s for s, r in enumerate(proj.max_rank) if r > 0]
    for first in range(0, len(active), MAX_SLICES):
        group = active[first : first + MAX_SLICES]
        t = lora_shrink(x, [lora_a[s] for s in group], proj, step, group, config)
        lora_expand(y, t, [lora_b[s] for s in group], proj, step, group, [offsets[s] for s in group], config)
