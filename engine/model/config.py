"""The decoder's shape, parsed once from a Hugging Face config.json (Llama 2/3, Mistral, Qwen2)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# RoPE variants whose inverse frequencies do not depend on the sequence length.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

# The adaptable linear layers: PEFT module name -> (projection kind it is fused into, slice index).
LORA_MODULES = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
PROJ_KINDS = ("qkv", "o", "gate_up", "down")
# Where each module lives inside a decoder layer, in HF (and PEFT) names.
MODULE_PARENT = {
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    name: str  # served model name: the model directory's name
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    hidden_act: str
    tie_word_embeddings: bool
    sliding_windows: tuple[int | None, ...]  # per layer; None = full causal attention
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type must be one of {SUPPORTED_MODEL_TYPES}, got {self.model_type!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {self.hidden_act!r}")

    def module_dims(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of an adaptable linear layer."""
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {
            "q_proj": (self.hidden_size, q_dim),
            "k_proj": (self.hidden_size, kv_dim),
            "v_proj": (self.hidden_size, kv_dim),
            "o_proj": (q_dim, self.hidden_size),
            "gate_proj": (self.hidden_size, self.intermediate_size),
            "up_proj": (self.hidden_size, self.intermediate_size),
            "down_proj": (self.intermediate_size, self.hidden_size),
        }[module]

    def kind_modules(self, kind: str) -> tuple[str, ...]:
        """The PEFT modules fused into one projection kind, in slice order."""
        return tuple(m for m, (k, _) in sorted(LORA_MODULES.items(), key=lambda kv: kv[1][1]) if k == kind)


def load_hf_config(model_dir: str | Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir))


def model_config_from_hf(hf_config, model_dir: str | Path) -> ModelConfig:
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    eos = hf_config.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    return ModelConfig(
        model_type=hf_config.model_type,
        name=Path(model_dir).resolve().name,
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        intermediate_size=hf_config.intermediate_size,
        vocab_size=hf_config.vocab_size,
        max_position_embeddings=hf_config.max_position_embeddings,
        rms_norm_eps=hf_config.rms_norm_eps,
        hidden_act=hf_config.hidden_act,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        sliding_windows=_sliding_windows(hf_config),
        eos_token_ids=eos_ids,
    )


def _sliding_windows(hf_config) -> tuple[int | None, ...]:
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    num_layers = hf_config.num_hidden_layers
    if layer_types:  # Qwen2 (and newer configs): a type per layer
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    return (window,) * num_layers


def rope_inv_freq(hf_config) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32, attention scaling of cos/sin), exactly as transformers computes them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_parameters.rope_type must be one of {SUPPORTED_ROPE_TYPES}, got {rope_type!r}")
    if rope_type != "default":
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
        return inv_freq.float(), float(scaling)
    base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return inv_freq, 1.0
