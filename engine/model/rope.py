"""Rotary position embedding, computed the way transformers does (float32 angles, cast to the model dtype)."""

from __future__ import annotations

import torch


class RotaryEmbedding:
    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, device: torch.device) -> None:
        self.inv_freq = inv_freq.to(device=device, dtype=torch.float32)  # [head_dim // 2]
        self.attention_scaling = attention_scaling

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [num_tokens] int64 -> (cos, sin), each [num_tokens, head_dim] in `dtype`."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; cos, sin: [num_tokens, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
