"""Read base weights from safetensors (one file or a sharded index) into fused per-layer tensors."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from kubelora.engine.model.config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Fused projection -> the HF modules concatenated along the output dimension, in order.
FUSED = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "o": ("self_attn.o_proj",),
         "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
         "down": ("mlp.down_proj",)}


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    post_attn_norm: torch.Tensor  # [hidden]
    weight: dict[str, torch.Tensor]  # kind -> [sum of out dims, in_dim]
    bias: dict[str, torch.Tensor | None]  # kind -> [sum of out dims] or None
    # kind -> (weight [out + staged rows, in_dim], bias [out + staged rows] or None): the weight and bias above are
    # their first rows (`extend_weights`, for staged shrinks: engine/adapters/staging.py)
    extended: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden] (the embedding itself when tied)
    layers: list[LayerWeights]


class CheckpointReader:
    """Name -> tensor over one safetensors file or the shards listed by model.safetensors.index.json."""

    def __init__(self, model_dir: Path) -> None:
        self._files = _weight_map(model_dir)

    def has(self, name: str) -> bool:
        return name in self._files

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        if name not in self._files:
            raise ValueError(f"checkpoint tensor {name!r} is missing")
        with safe_open(str(self._files[name]), framework="pt") as f:
            return f.get_tensor(name).to(dtype)


def _weight_map(model_dir: Path) -> dict[str, Path]:
    index = model_dir / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / SINGLE_FILE
    if not single.exists():
        raise FileNotFoundError(f"{model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def load_weights(model_dir: str | Path, config: ModelConfig, dtype: torch.dtype) -> ModelWeights:
    reader = CheckpointReader(Path(model_dir))
    embed = reader.get("model.embed_tokens.weight", dtype)
    lm_head = embed if config.tie_word_embeddings or not reader.has("lm_head.weight") else reader.get(
        "lm_head.weight", dtype)
    layers = [_load_layer(reader, f"model.layers.{i}.", dtype) for i in range(config.num_layers)]
    return ModelWeights(embed=embed, final_norm=reader.get("model.norm.weight", dtype), lm_head=lm_head,
                        layers=layers)


def _load_layer(reader: CheckpointReader, prefix: str, dtype: torch.dtype) -> LayerWeights:
    weight, bias = {}, {}
    for kind, modules in FUSED.items():
        weight[kind] = torch.cat([reader.get(f"{prefix}{m}.weight", dtype) for m in modules])
        bias[kind] = _fused_bias(reader, [f"{prefix}{m}" for m in modules], weight[kind], dtype)
    return LayerWeights(
        input_norm=reader.get(f"{prefix}input_layernorm.weight", dtype),
        post_attn_norm=reader.get(f"{prefix}post_attention_layernorm.weight", dtype),
        weight=weight,
        bias=bias,
    )


def _fused_bias(reader: CheckpointReader, names: list[str], weight: torch.Tensor, dtype: torch.dtype):
    """Concatenated biases, zeros for a module without one; None when no module of the kind has a bias."""
    if not any(reader.has(f"{n}.bias") for n in names):
        return None
    parts = []
    for n in names:
        out_dim = reader.get(f"{n}.weight", dtype).shape[0]
        parts.append(reader.get(f"{n}.bias", dtype) if reader.has(f"{n}.bias") else torch.zeros(out_dim, dtype=dtype))
    return torch.cat(parts)


def extend_weights(weights: ModelWeights, rows: dict[str, int], device: torch.device) -> dict[str, torch.Tensor]:
    """Put each kind's weights into one `[num_layers, out_dim + rows[kind], in_dim]` device buffer (extra rows
    zero) and return the buffers; every layer's weight (and bias, extended with zeros) becomes a view of its
    first out_dim rows, with `LayerWeights.extended` the whole layer. The host tensors are copied straight in."""
    buffers = {}
    for kind, extra in rows.items():
        first = weights.layers[0].weight[kind]
        out_dim, in_dim = first.shape
        buf = torch.zeros(len(weights.layers), out_dim + extra, in_dim, dtype=first.dtype, device=device)
        for i, layer in enumerate(weights.layers):
            buf[i, :out_dim].copy_(layer.weight[kind])
            bias = layer.bias[kind]
            ext_bias = None
            if bias is not None:
                ext_bias = torch.zeros(out_dim + extra, dtype=bias.dtype, device=device)
                ext_bias[:out_dim].copy_(bias)
                layer.bias[kind] = ext_bias[:out_dim]
            layer.weight[kind] = buf[i, :out_dim]
            layer.extended[kind] = (buf[i], ext_bias)
        buffers[kind] = buf
    return buffers
