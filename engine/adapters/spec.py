"""Validated adapter metadata and host-resident weights (the `known` and `host` tiers' payloads)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class AdapterLimits:
    """What the served model and engine accept; handed to validation by the adapter manager."""

    max_lora_rank: int
    model_names: tuple[str, ...]  # names the served base model answers to (for base_model_name_or_path)
    is_base_model_strict: bool  # mismatch of base_model_name_or_path: error (True) or warning (False)
    model_dir: str | None = None  # the base checkpoint, which PEFT's full embedding/lm_head copies must equal
    base_format: str | None = None  # the base weights' quantized format (None: unquantized; DoRA needs W)


@dataclass(frozen=True)
class AdapterSpec:
    """An adapter's validated metadata: enough to budget it and to read its weights later."""

    name: str
    path: str
    revision: str  # short sha256 of adapter_config.json + adapter_model.safetensors
    num_weight_bytes: int  # adapter_model.safetensors' size, as its header accounts for every byte
    ranks: dict[str, int]  # PEFT module (q_proj, ...) -> rank (max over layers; smaller layers zero-padded)
    scales: dict[str, float]  # module -> alpha / r (or alpha / sqrt(r) with rsLoRA)
    # (layer, module) -> (lora_A key, lora_B key); layer -1 for the vocabulary-wide modules (embed_tokens: PEFT's
    # lora_embedding_A/B, lm_head)
    tensor_names: dict[tuple[int, str], tuple[str, str]]
    base_model: str  # base_model_name_or_path as written by PEFT
    use_rslora: bool
    use_dora: bool = False  # DoRA: every module's lora_magnitude_vector, named in magnitude_names
    magnitude_names: dict[tuple[int, str], str] = field(default_factory=dict)  # (layer, PEFT module) -> key

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
    adapter does not touch, and rank rows beyond a layer's own rank, are zero. A vocabulary-wide module's rows are
    cut into num_layers pieces as the pool holds them (engine/adapters/pool.py): [num_layers, rank, piece].
    magnitude[module]: DoRA's [num_layers, out_dim] (empty without DoRA).
    """

    a: dict[str, torch.Tensor]
    b: dict[str, torch.Tensor]
    magnitude: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        tensors = (*self.a.values(), *self.b.values(), *self.magnitude.values())
        return sum(t.numel() * t.element_size() for t in tensors)
