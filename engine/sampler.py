"""Token sampling: greedy, temperature, top-k, top-p; per-request seeded generators."""

from __future__ import annotations

import torch

from kubelora.engine.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits: [num_seqs, vocab] float32 -> one token id per row.

    Filters run batched; the draw is per row only for seeded requests, so a seeded request gives the same
    tokens whatever else shares its batch.
    """
    greedy = logits.argmax(dim=-1)
    if all(p.is_greedy for p in params):
        return greedy.tolist()
    probs = _filtered_probs(logits, params)
    tokens = greedy.clone()
    sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    unseeded = [i for i in sampled_rows if generators[i] is None]
    if unseeded:
        tokens[unseeded] = torch.multinomial(probs[unseeded], 1).squeeze(1)
    for i in sampled_rows:
        if generators[i] is not None:
            tokens[i] = torch.multinomial(probs[i], 1, generator=generators[i])[0]
    return tokens.tolist()


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    temperature = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params],
                               dtype=logits.dtype, device=logits.device)
    scaled = logits / temperature[:, None]
    top_k = [p.top_k for p in params]
    if any(k > 0 for k in top_k):
        scaled = _apply_top_k(scaled, top_k)
    top_p = [p.top_p for p in params]
    if any(p < 1.0 for p in top_p):
        scaled = _apply_top_p(scaled, torch.tensor(top_p, dtype=logits.dtype, device=logits.device))
    return torch.softmax(scaled, dim=-1)


def _apply_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    vocab = logits.shape[-1]
    k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k], device=logits.device)
    sorted_desc = logits.sort(dim=-1, descending=True).values
    kth = sorted_desc.gather(1, (k - 1)[:, None])  # [num_seqs, 1] the k-th largest value
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest prefix of tokens (by probability) whose mass reaches top_p; always the top one."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= top_p[:, None]
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
