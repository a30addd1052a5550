"""LoRA on the vocabulary-wide modules, beside the batched projections of kernels/lora.py, as PyTorch ops inside the
step (on CUDA they are captured into the step's graph with the rest; the CPU runs the same ops). (DoRA's output
scale is applied by the projections' own ops: kernels/lora.py, the expand launch's store.)

- LoRA on embed_tokens: hidden[t] += scale * A[:, token]^T @ B^T (a gather of A's column, a rank-r matmul),
  before the family's embedding scale multiplies both (PEFT scales the adapter's output by it too).
- LoRA on lm_head: logits[t] += scale * (h A^T) B^T, before any soft-cap.

Every mask selects (where, gather) and never multiplies by zero, so one adapter's rows never reach another
adapter's tokens. A vocabulary-wide module's rows are held in pieces, one per layer (`vocab_rows`).
"""

from __future__ import annotations

import torch

from kubelora.kernels.lora import LoRAProj, LoRAStep


def vocab_rows(view: torch.Tensor, rows: torch.Tensor, dim: int) -> torch.Tensor:
    """Logical rows of a vocabulary-wide module's part: view [num_layers, num_rows, piece], rows of any shape ->
    [*rows.shape, dim] (row i's pieces laid end to end)."""
    pieces = view[:, rows]  # [num_layers, *rows.shape, piece]
    return pieces.movedim(0, -2).reshape(*rows.shape, -1)[..., :dim]


def _lanes(proj: LoRAProj, slots: torch.Tensor, row_start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid [n, lanes], rows [n, lanes]): each entry's rows from row_start, lanes past its rank on row 0."""
    lanes = torch.arange(proj.max_rank[0], device=slots.device)
    valid = lanes < proj.rank[slots, 0, None]
    return valid, torch.where(valid, row_start[slots, 0, None] + lanes, 0)


def _expand(shrink: torch.Tensor, b_view: torch.Tensor, proj: LoRAProj, slots: torch.Tensor, num_slots: int,
            dim: int) -> torch.Tensor:
    """[n, dim]: shrink[i] @ B^T of slots[i]'s adapter (B^T rows read one slot at a time: at most [lanes, dim])."""
    table = torch.arange(num_slots, device=slots.device)
    valid, rows = _lanes(proj, table, proj.b_rows)
    zero = torch.zeros((), dtype=b_view.dtype, device=b_view.device)
    delta = torch.zeros(shrink.shape[0], dim, dtype=shrink.dtype, device=shrink.device)
    for slot in range(num_slots):
        b_slot = torch.where(valid[slot, :, None], vocab_rows(b_view, rows[slot], dim), zero)
        delta = torch.where((slots == slot)[:, None], shrink @ b_slot.to(shrink.dtype), delta)
    return delta


def add_embed_lora_(hidden: torch.Tensor, token_ids: torch.Tensor, views: tuple[torch.Tensor, torch.Tensor],
                    proj: LoRAProj, step: LoRAStep) -> None:
    """hidden [num_tokens, hidden] (the embedding lookup, before any scale) += scale * A[:, token]^T @ B^T for
    each token whose adapter adapts embed_tokens. views: the pool's (A, B^T) rows of embed_tokens (pieces)."""
    a_view, b_view = views
    piece = a_view.shape[2]
    slots = step.token_slots.clamp(min=0)
    valid, rows = _lanes(proj, slots, proj.row_start)
    picked = a_view[(token_ids // piece)[:, None], rows, (token_ids % piece)[:, None]]  # [num_tokens, lanes]
    zero = torch.zeros((), dtype=picked.dtype, device=picked.device)
    shrink = torch.where(valid, picked, zero).to(hidden.dtype) * proj.scale[slots, 0, None].to(hidden.dtype)
    delta = _expand(shrink, b_view, proj, slots, step.num_slots, hidden.shape[1])
    has = (step.token_slots >= 0) & (proj.rank[slots, 0] > 0)
    hidden.copy_(torch.where(has[:, None], hidden + delta, hidden))


def add_lm_head_lora_(logits: torch.Tensor, hidden: torch.Tensor, token_slots: torch.Tensor,
                      views: tuple[torch.Tensor, torch.Tensor], proj: LoRAProj, num_slots: int) -> None:
    """logits [n, vocab] += scale * (h A^T) B^T for each row whose adapter adapts lm_head; hidden [n, hidden] the
    rows' final hidden states, token_slots [n] their slots (-1: none)."""
    a_view, b_view = views
    slots = token_slots.clamp(min=0)
    table = torch.arange(num_slots, device=slots.device)
    valid, rows = _lanes(proj, table, proj.row_start)
    zero = torch.zeros((), dtype=a_view.dtype, device=a_view.device)
    a_slots = torch.where(valid[..., None], vocab_rows(a_view, rows, hidden.shape[1]), zero)  # [slots, lanes, hidden]
    lanes = a_slots.shape[1]
    shrink_all = (hidden @ a_slots.to(hidden.dtype).reshape(-1, hidden.shape[1]).T).view(-1, num_slots, lanes)
    shrink = shrink_all.gather(1, slots[:, None, None].expand(-1, 1, lanes)).squeeze(1)
    shrink = shrink * proj.scale[slots, 0, None].to(hidden.dtype)
    delta = _expand(shrink, b_view, proj, slots, num_slots, logits.shape[1])
    has = (token_slots >= 0) & (proj.rank[slots, 0] > 0)
    logits.copy_(torch.where(has[:, None], logits + delta.to(logits.dtype), logits))
