"""Read base weights from safetensors (one file or a sharded index) into fused per-layer tensors."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors import safe_open

from kubelora.engine.model.config import LORA_MODULES, ModelConfig
from kubelora.engine.model.quantized import Fp8Linear, is_stored_fp8, read_fp8_linear

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Where a checkpoint keeps its language model -> its lm_head's name, when stored: plain decoders, then the two
# layouts of multimodal Gemma 3 checkpoints (both read by transformers 5)
DECODERS = {"model.": "lm_head.weight", "model.language_model.": "lm_head.weight",
            "language_model.model.": "language_model.lm_head.weight"}
# Norm role -> its weight's name inside a decoder layer. "pre_mlp" is Llama's post_attention_layernorm and
# Gemma's pre_feedforward_layernorm; with post-norms (Gemma) post_attention_layernorm is the attention output's.
NORMS = {"input": "input_layernorm", "pre_mlp": "post_attention_layernorm", "q": "self_attn.q_norm",
         "k": "self_attn.k_norm"}
POST_NORMS = {"input": "input_layernorm", "attn_out": "post_attention_layernorm",
              "pre_mlp": "pre_feedforward_layernorm", "mlp_out": "post_feedforward_layernorm",
              "q": "self_attn.q_norm", "k": "self_attn.k_norm"}


@dataclass
class LayerWeights:
    # role -> [hidden] ("input", "pre_mlp"; "attn_out", "mlp_out" with post-norms) or [head_dim] ("q", "k")
    norm: dict[str, torch.Tensor]
    weight: dict[str, torch.Tensor | Fp8Linear]  # kind -> [sum of out dims, in_dim] (FP8: engine/model/quantized.py)
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

    def to(self, device: torch.device) -> ModelWeights:
        """A copy on `device` (the lm_head stays the embedding itself when tied); staged buffers are not moved."""
        def move(tensor):
            return None if tensor is None else tensor.to(device)

        layers = [replace(layer, norm={k: move(v) for k, v in layer.norm.items()},
                          weight={k: move(v) for k, v in layer.weight.items()},
                          bias={k: move(v) for k, v in layer.bias.items()}) for layer in self.layers]
        embed = move(self.embed)
        lm_head = embed if self.lm_head is self.embed else move(self.lm_head)
        return replace(self, embed=embed, final_norm=move(self.final_norm), lm_head=lm_head, layers=layers)


def module_weight(weights: ModelWeights, config: ModelConfig, layer: int, module: str) -> torch.Tensor:
    """One engine module's W [out_dim, in_dim]: its rows of the layer's fused projection (a view)."""
    kind, _ = LORA_MODULES[module]
    first = 0
    for other in config.kind_modules(kind):
        out_dim = config.module_dims(other)[1]
        if other == module:
            return weights.layers[layer].weight[kind][first : first + out_dim]
        first += out_dim
    raise KeyError(module)


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

    def shape(self, name: str) -> tuple[int, ...]:
        with safe_open(str(self._files[name]), framework="pt") as f:
            return tuple(f.get_slice(name).get_shape())

    def rows(self, name: str, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of a 2-D tensor, read alone (the rest of the tensor is not read)."""
        with safe_open(str(self._files[name]), framework="pt") as f:
            return f.get_slice(name)[start:end]

    def vocab_names(self, config: ModelConfig) -> dict[str, str]:
        """The checkpoint's names of the embedding and the lm_head ("embed_tokens", "lm_head" -> name): the
        embedding's for the lm_head when tied or not stored."""
        found = [prefix for prefix in DECODERS if self.has(f"{prefix}embed_tokens.weight")]
        if not found:
            raise ValueError(f"checkpoint tensor 'model.embed_tokens.weight' is missing (looked under "
                             f"{list(DECODERS)})")
        embed, lm_head = f"{found[0]}embed_tokens.weight", DECODERS[found[0]]
        is_tied = config.tie_word_embeddings or not self.has(lm_head)
        return {"embed_tokens": embed, "lm_head": embed if is_tied else lm_head}


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
    names = reader.vocab_names(config)
    prefix = names["embed_tokens"].removesuffix("embed_tokens.weight")
    embed = reader.get(names["embed_tokens"], dtype)
    lm_head = embed if names["lm_head"] == names["embed_tokens"] else reader.get(names["lm_head"], dtype)
    layers = [_load_layer(reader, f"{prefix}layers.{i}.", config, dtype) for i in range(config.num_layers)]
    return ModelWeights(embed=embed, final_norm=reader.get(f"{prefix}norm.weight", dtype), lm_head=lm_head,
                        layers=layers)


def _load_layer(reader: CheckpointReader, prefix: str, config: ModelConfig, dtype: torch.dtype) -> LayerWeights:
    family = config.family
    weight, bias = {}, {}
    for kind, modules in family.checkpoint.items():
        names = [f"{prefix}{m}" for m in modules]
        if is_stored_fp8(config.quantization, names):  # FP8 values and scales as stored (engine/model/quantized.py)
            weight[kind] = read_fp8_linear(reader, names, config.quantization)
        else:
            weight[kind] = torch.cat([reader.get(f"{n}.weight", dtype) for n in names])
        bias[kind] = _fused_bias(reader, [f"{prefix}{m}" for m in modules], dtype)
    names = POST_NORMS if family.has_post_norms else NORMS
    roles = [r for r in names if family.has_qk_norm or r not in ("q", "k")]
    return LayerWeights(norm={r: reader.get(f"{prefix}{names[r]}.weight", dtype) for r in roles}, weight=weight,
                        bias=bias)


def _fused_bias(reader: CheckpointReader, names: list[str], dtype: torch.dtype):
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
