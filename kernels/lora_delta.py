"""A decode step's LoRA expands done by the launches that read the projections' outputs next.

On a decode step each adapted projection is two launches, the shrink (t = x @ A^T) and the expand (y += scale *
t @ B^T, atomic adds into y), and the next op reads y right after: the rotary kernel (q, k, v, with the KV-cache
write) and the post-attention residual add + RMSNorm (o). Here the expand's launch goes: the projection runs
its matmul and the shrink, and that next op (`fused.rotary_kv_cache_`, `fused.add_rms_norm` with a
`fused.LoRADelta`) adds each token's delta in registers, rounded as the decode expand rounds it (`y +
bf16(delta)`): its program for a token (and group of heads) reads the token's row of t (`LoRAStep.token_rows`)
and its adapter's rows of B for its columns. Tokens of one adapter read B once each (from L2 after the first), so
`is_decode_delta` takes steps of 16-row tiles of at most MAX_TILE_TOKENS tokens, the decode shape, and leaves
anything taller (a prefill) to the expand launch.
"""

from __future__ import annotations

import torch

from kubelora.kernels import fused
from kubelora.kernels.lora import LoRAProj, LoRAStep

# The most tokens of one adapter a step may have for the next op to take the expand (each reads B on its own).
MAX_TILE_TOKENS = 8


def is_decode_delta(proj: LoRAProj, step: LoRAStep) -> bool:
    """Whether a projection of this step leaves its expand to the next op: a decode-shaped step (16-row tiles of
    at most MAX_TILE_TOKENS tokens, its token -> row map present) with an adapter on some slice."""
    return (step.has_lora and step.block_m == 16 and step.max_tile_count <= MAX_TILE_TOKENS
            and step.token_rows is not None and max(proj.max_rank, default=0) > 0)


def shrink_delta(x: torch.Tensor, lora_a: list[torch.Tensor], lora_b: list[torch.Tensor], proj: LoRAProj,
                 step: LoRAStep) -> fused.LoRADelta:
    """Triton: the step's shrink of x for a projection where `is_decode_delta` holds, as the deltas the next op
    adds (as `add_lora` would have added them to the projection's output). lora_a, lora_b: every slice's pool."""
    from kubelora.kernels.lora_shrink import launch_shrink
    from kubelora.kernels.lora_triton import step_groups

    (group,) = step_groups(x, lora_b, proj, step)  # at most 3 slices: one launch
    t = launch_shrink(x, [lora_a[s] for s in group.slices], proj, step, group.slices, group.config,
                      shape=group.shrink)
    t_cols = tuple(group.slices.index(s) if s in group.slices else -1 for s in range(len(lora_b)))
    return fused.LoRADelta(t=t, t_cols=t_cols, b=tuple(lora_b), rows=step.token_rows, slots=step.token_slots,
                           rank=proj.rank, row_start=proj.row_start, scale=proj.scale)
