"""Benchmark inputs and the PyTorch baselines the Triton LoRA op is timed against.

A `BenchSet` is one independent copy of a batch's inputs (x, y, the adapters' weights at their own ranks in
the pools, and the same weights in the layouts the baselines want). The bench rotates through several sets
so that no call finds its weights in the 60 MiB L2 left behind by the previous one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kubelora.kernels.lora import LoRAProj, LoRAStep, add_lora_torch, prepare_lora_proj


@dataclass
class AdapterGroup:
    """One adapter's tokens and weights for the per-adapter loop."""

    tokens: torch.Tensor  # [n] int64 token ids
    a_cat: torch.Tensor  # [num_slices * rank, in_dim]: the slices' A stacked, one shrink matmul
    b: list[torch.Tensor]  # per slice [rank, d_s]
    rank: int
    scale: float


@dataclass
class BenchSet:
    x: torch.Tensor  # [num_tokens, in_dim]
    y: torch.Tensor  # [num_tokens, sum d_s]
    proj: LoRAProj
    step: LoRAStep
    lora_a: list[torch.Tensor]  # shared pools, every set's adapters in them at their own rank
    lora_b: list[torch.Tensor]
    token_adapter: torch.Tensor  # [num_tokens] int64: row of the padded stacks (gather+bmm)
    a_stack: list[torch.Tensor]  # per slice [num_adapters_total, max_rank, in_dim], zero padded
    b_stack: list[torch.Tensor]  # per slice [num_adapters_total, max_rank, d_s]
    scale_stack: torch.Tensor  # [num_adapters_total] scales
    groups: list[AdapterGroup]


def build_sets(slots: list[int], ranks: list[int], widths: list[int], in_dim: int, num_sets: int,
               step: LoRAStep, dtype: torch.dtype, seed: int = 0, device: str = "cuda") -> list[BenchSet]:
    """num_sets independent copies; adapter n of set k is pool adapter k * len(ranks) + n, at rank ranks[n]."""
    gen = torch.Generator(device=device).manual_seed(seed)
    num_adapters, max_rank, num_tokens = len(ranks), max(ranks), len(slots)
    total = num_sets * num_adapters
    all_ranks = ranks * num_sets
    starts = [sum(all_ranks[:i]) for i in range(total)]
    to = dict(device=device, dtype=dtype)
    lora_a = [torch.randn(sum(all_ranks), in_dim, generator=gen, **to) / in_dim**0.5 for _ in widths]
    lora_b = [torch.randn(sum(all_ranks), w, generator=gen, **to) / max_rank**0.5 for w in widths]
    a_stack = [torch.zeros(total, max_rank, in_dim, **to) for _ in widths]
    b_stack = [torch.zeros(total, max_rank, w, **to) for w in widths]
    for s in range(len(widths)):
        for i, (start, rank) in enumerate(zip(starts, all_ranks)):
            a_stack[s][i, :rank] = lora_a[s][start : start + rank]
            b_stack[s][i, :rank] = lora_b[s][start : start + rank]
    scales = torch.rand(total, generator=gen, device=device) + 0.5
    slot_tensor = torch.tensor(slots, device=device)
    sets = []
    for k in range(num_sets):
        ids = list(range(k * num_adapters, (k + 1) * num_adapters))
        proj = prepare_lora_proj([[starts[i]] * len(widths) for i in ids], [[all_ranks[i]] * len(widths) for i in ids],
                                 [[float(scales[i])] * len(widths) for i in ids], device)
        groups = []
        for n, i in enumerate(ids):
            tokens = torch.nonzero(slot_tensor == n).flatten()
            rows = slice(starts[i], starts[i] + all_ranks[i])
            groups.append(AdapterGroup(tokens, torch.cat([a[rows] for a in lora_a]), [b[rows] for b in lora_b],
                                       all_ranks[i], float(scales[i])))
        sets.append(BenchSet(
            x=torch.randn(num_tokens, in_dim, generator=gen, **to), y=torch.randn(num_tokens, sum(widths), **to),
            proj=proj, step=step, lora_a=lora_a, lora_b=lora_b, token_adapter=slot_tensor + k * num_adapters,
            a_stack=a_stack, b_stack=b_stack, scale_stack=scales.to(dtype), groups=groups,
        ))
    return sets


def gather_bmm(st: BenchSet) -> None:
    """Each token gathers its adapter's A and B (padded to the max rank) and runs two batched matmuls."""
    offset = 0
    scale = st.scale_stack[st.token_adapter][:, None]
    for a_stack, b_stack in zip(st.a_stack, st.b_stack):
        width = b_stack.shape[2]
        t = torch.bmm(a_stack[st.token_adapter], st.x[:, :, None])  # [T, R, 1]
        delta = torch.bmm(t.transpose(1, 2), b_stack[st.token_adapter])[:, 0]  # [T, d]
        st.y[:, offset : offset + width] += delta * scale
        offset += width


def per_adapter_loop(st: BenchSet) -> None:
    """For each adapter: gather its tokens, one shrink matmul over all slices, one expand + index_add per slice."""
    for g in st.groups:
        t = st.x[g.tokens] @ g.a_cat.T  # [n, num_slices * rank]
        offset = 0
        for s, b in enumerate(g.b):
            width = b.shape[1]
            st.y[:, offset : offset + width].index_add_(0, g.tokens, t[:, s * g.rank : (s + 1) * g.rank] @ b,
                                                        alpha=g.scale)
            offset += width


def torch_reference(st: BenchSet) -> None:
    """kubelora's own reference path (dense masked matmuls, no loop over adapters)."""
    add_lora_torch(st.y, st.x, st.lora_a, st.lora_b, st.proj, st.step)
