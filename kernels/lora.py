"""Batched multi-LoRA for one projection: every token carries its own adapter, each adapter its own rank.

Storage (the engine's device adapter pool, one buffer pair per layer and per output slice of a fused
projection such as q/k/v or gate/up), each adapter stored at its own rank, never padded:

    lora_a[s]: [num_rows_s, in_dim]    rows row_start[a, s] : row_start[a, s] + rank[a, s] hold A_a for slice s
    lora_b[s]: [num_rows_s, out_dim_s] the same rows hold B_a^T for slice s

Semantics, for every token t whose step slot a = token_slots[t] >= 0 and every slice s:

    y[t, off_s : off_s + out_dim_s] += scale[a, s] * (x[t] @ A_a,s^T) @ B_a,s^T

Tokens with slot -1 and slices with rank 0 leave y untouched. `LoRAStep` (once per step) and `LoRAProj`
(once per step and projection kind) are built on the host side by `prepare_*` and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRAStep:
    """Per-step token -> adapter map, shared by all layers and projections."""

    token_slots: torch.Tensor  # [num_tokens] int64: the token's slot in this step's adapter table; -1 = none
    num_slots: int  # number of distinct adapters in the step (slot table length)
    has_lora: bool  # any token with an adapter at all; False skips every LoRA op


@dataclass(frozen=True)
class LoRAProj:
    """Per-step pool addresses of each slot's adapter for one projection kind (e.g. "qkv")."""

    row_start: torch.Tensor  # [num_slots, num_slices] int64: first pool row of the slot's adapter, per slice
    rank: torch.Tensor  # [num_slots, num_slices] int64: 0 where the adapter does not adapt the slice
    scale: torch.Tensor  # [num_slots, num_slices] float32
    max_rank: tuple[int, ...]  # per slice, max of rank[:, s]: sizes the shrink buffer; 0 skips the slice


def prepare_lora_step(token_slots: list[int], num_slots: int, device: torch.device | str) -> LoRAStep:
    slots = torch.tensor(token_slots, dtype=torch.int64)
    return LoRAStep(token_slots=slots.to(device), num_slots=num_slots, has_lora=bool((slots >= 0).any()))


def prepare_lora_proj(
    row_start: list[list[int]], rank: list[list[int]], scale: list[list[float]], device: torch.device | str
) -> LoRAProj:
    """Pack one projection's slot table (outer list: slots, inner: slices) into device tensors."""
    ranks = torch.tensor(rank, dtype=torch.int64).reshape(len(rank), -1)
    max_rank = tuple(int(r) for r in ranks.max(dim=0).values) if len(rank) else ()
    return LoRAProj(
        row_start=torch.tensor(row_start, dtype=torch.int64).reshape(ranks.shape).to(device),
        rank=ranks.to(device),
        scale=torch.tensor(scale, dtype=torch.float32).reshape(ranks.shape).to(device),
        max_rank=max_rank,
    )


def add_lora_torch(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    proj: LoRAProj,
    step: LoRAStep,
) -> None:
    """Reference: y[t, off_s:off_s+d_s] += scale[a,s] * (x[t] @ A_{a,s}^T) @ B_{a,s}^T with a = slot of t.

    y: [num_tokens, sum_s d_s], x: [num_tokens, in_dim], lora_a[s]: [num_rows_s, in_dim],
    lora_b[s]: [num_rows_s, d_s]. One dense masked matmul pair per slice, no loop over adapters: each
    token's shrink row is gathered from the product with every slot's A, then scattered into its slot's
    column block before the expand, so other slots contribute exact zeros.
    """
    if not step.has_lora:
        return
    num_tokens = x.shape[0]
    has_slot = step.token_slots >= 0
    slots = step.token_slots.clamp(min=0)
    offset = 0
    for s, (a_pool, b_pool) in enumerate(zip(lora_a, lora_b)):
        width = b_pool.shape[1]
        max_rank = proj.max_rank[s]
        if max_rank > 0:
            lanes = torch.arange(max_rank, device=x.device)
            rows = proj.row_start[:, s, None] + lanes  # [num_slots, max_rank]
            valid = lanes < proj.rank[:, s, None]  # [num_slots, max_rank]
            rows = torch.where(valid, rows, torch.zeros_like(rows))
            a_slots = a_pool[rows] * valid[..., None].to(a_pool.dtype)  # [num_slots, max_rank, in_dim]
            b_slots = b_pool[rows] * valid[..., None].to(b_pool.dtype)  # [num_slots, max_rank, d_s]
            shrink_all = x @ a_slots.reshape(-1, x.shape[1]).T  # [num_tokens, num_slots * max_rank]
            shrink_all = shrink_all.view(num_tokens, step.num_slots, max_rank)
            keep = torch.nn.functional.one_hot(slots, step.num_slots).to(x.dtype) * has_slot[:, None].to(x.dtype)
            token_scale = proj.scale[slots, s].to(x.dtype)  # [num_tokens]
            shrink = shrink_all * (keep * token_scale[:, None])[..., None]  # zero outside the token's slot
            delta = shrink.reshape(num_tokens, -1) @ b_slots.reshape(-1, width)  # [num_tokens, d_s]
            y[:, offset : offset + width] += delta.to(y.dtype)
        offset += width


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    proj: LoRAProj,
    step: LoRAStep,
    backend: str = "torch",
) -> None:
    """Dispatch to the backend chosen once at engine start ("torch" reference or "triton")."""
    add_lora_torch(y, x, lora_a, lora_b, proj, step)
