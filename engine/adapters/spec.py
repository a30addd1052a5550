"""Validated adapter metadata and host-resident weights (the `known` and `host` tiers' payloads)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdapterLimits:
    """What the served model and engine accept; handed to validation by the adapter manager."""

    max_lora_rank: int
    max_pool_rows: int  # rows per module in the device pool: an adapter's rank must fit
    model_names: tuple[str, ...]  # names the served base model answers to (for base_model_name_or_path)
    is_base_model_strict: bool  # mismatch of base_model_name_or_path: error (True) or warning (False)


@dataclass(frozen=True)
class AdapterSpec:
    """An adapter's validated metadata: enough to budget it and to read its weights later."""

    name: str
    path: str
    revision: str  # short sha256 of adapter_config.json + adapter_model.safetensors
    num_weight_bytes: int  # adapter_model.safetensors' size, as its header accounts for every byte
    ranks: dict[str, int]  # PEFT module (q_proj, ...) -> rank (max over layers; smaller layers zero-padded)
    scales: dict[str, float]  # module -> alpha / r (or alpha / sqrt(r) with rsLoRA)
    tensor_names: dict[tuple[int, str], tuple[str, str]]  # (layer, module) -> (lora_A key, lora_B key)
    base_model: str  # base_model_name_or_path as written by PEFT
    use_rslora: bool

    @property
    def max_rank(self) -> int:
        return max(self.ranks.values())

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(sorted(self.ranks))


@dataclass
class HostAdapter:
    """Weights staged in host memory (pinned on CUDA), laid out for one copy per module into the pool.

    a[module]: [num_layers, rank, in_dim]; b[module]: [num_layers, rank, out_dim] (B transposed). Layers the
    adapter does not touch, and rank rows beyond a layer's own rank, are zero.
    """

    a: dict[str, torch.Tensor]
    b: dict[str, torch.Tensor]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values()))
