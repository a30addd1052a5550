"""The engine benchmark's model directory and PEFT adapters, made from random tensors on the benchmark's device.

`write_model` writes a Hugging Face Llama directory (config.json, sharded model.safetensors with its index, a
tokenizer); `write_adapter` a PEFT LoRA directory (adapter_config.json, adapter_model.safetensors) with PEFT's
key names. Tensors are made on the device and handed to safetensors from there (it copies each to the host
as it writes), so a 7B model takes seconds of GPU time and the disk's write time, not a host-side init.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
WEIGHT_STD = 0.02  # transformers' initializer_range for Llama: activations stay finite through 32 layers
SHARD_BYTES = 2 << 30  # layers per shard so that each file is at most about this size
TOKENIZER_BPE_VOCAB = 512  # trained on the shipped corpus; the other ids up to the model's vocab are added tokens
NUM_WRITERS = 4  # shards / adapters handed to safetensors at once (device->host copy and disk write overlap)


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 4096

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelShape.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must divide by num_heads ({self.num_heads}), "
                             f"and num_heads by num_kv_heads ({self.num_kv_heads})")
        if self.vocab_size < TOKENIZER_BPE_VOCAB:
            raise ValueError(f"ModelShape.vocab_size must be >= {TOKENIZER_BPE_VOCAB}, got {self.vocab_size}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def module_dims(self, module: str) -> tuple[int, int]:
        """(in, out) features of one projection."""
        kv = self.num_kv_heads * self.head_dim
        h, i = self.hidden_size, self.intermediate_size
        return {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[module]

    def layer_params(self) -> int:
        return sum(i * o for i, o in map(self.module_dims, ATTENTION + MLP)) + 2 * self.hidden_size

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


SHAPES = {
    "7b": ModelShape(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32, intermediate_size=11008,
                     vocab_size=32000),  # Llama-2-7B
    "8b": ModelShape(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, intermediate_size=14336,
                     vocab_size=128256, max_position_embeddings=131072),  # Llama-3.1-8B (GQA: 128 KiB of KV a token)
    "tiny": ModelShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                       vocab_size=512, max_position_embeddings=2048),
}


def shape_of(model_dir: Path) -> ModelShape:
    """The shape of an existing Hugging Face Llama-family directory (config.json)."""
    config = json.loads((model_dir / "config.json").read_text())
    return ModelShape(hidden_size=config["hidden_size"], num_layers=config["num_hidden_layers"],
                      num_heads=config["num_attention_heads"],
                      num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
                      intermediate_size=config["intermediate_size"], vocab_size=config["vocab_size"],
                      max_position_embeddings=config["max_position_embeddings"])


def with_overrides(shape: ModelShape, **sizes: int | None) -> ModelShape:
    return replace(shape, **{k: v for k, v in sizes.items() if v is not None})


# ---- model ----

def write_model(out: Path, shape: ModelShape, device: str, seed: int = 0) -> Path:
    """A random bf16 Llama directory for `shape`; returns `out`."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(shape.vocab_size)
    tokenizer.save_pretrained(out)
    _write_config(out, shape, tokenizer)
    generator = torch.Generator(device=device).manual_seed(seed)
    groups = _shard_groups(shape)
    weight_map, total = {}, 0
    with ThreadPoolExecutor(NUM_WRITERS) as writers:
        jobs = []
        for index, group in enumerate(groups):
            name = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
            tensors = {key: _random(dims, device, generator) for key, dims in group}
            weight_map.update(dict.fromkeys(tensors, name))
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            jobs.append(writers.submit(_save, tensors, out / name))
        for job in jobs:
            job.result()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def build_tokenizer(vocab_size: int):
    """kubelora's tiny BPE tokenizer (cli/tiny.py) with added tokens up to `vocab_size`, so that every id the
    model can generate decodes to text and a streamed completion sends one chunk per token."""
    from kubelora.cli.tiny import build_tokenizer as build_bpe

    tokenizer = build_bpe(TOKENIZER_BPE_VOCAB)
    tokenizer.add_tokens([f"<t{i}>" for i in range(len(tokenizer), vocab_size)])
    return tokenizer


def _write_config(out: Path, shape: ModelShape, tokenizer) -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
                         num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
                         num_key_value_heads=shape.num_kv_heads, vocab_size=shape.vocab_size,
                         max_position_embeddings=shape.max_position_embeddings, rms_norm_eps=1e-5,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(out)


def _shard_groups(shape: ModelShape) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Tensor names and shapes, grouped into shards: embeddings first, then runs of whole layers, then the head."""
    h, v = shape.hidden_size, shape.vocab_size
    per_shard = max(1, SHARD_BYTES // (2 * shape.layer_params()))
    groups = [[("model.embed_tokens.weight", (v, h))]]
    for start in range(0, shape.num_layers, per_shard):
        group = []
        for layer in range(start, min(start + per_shard, shape.num_layers)):
            prefix = f"model.layers.{layer}."
            group += [(f"{prefix}input_layernorm.weight", (h,)), (f"{prefix}post_attention_layernorm.weight", (h,))]
            for module in ATTENTION + MLP:
                in_dim, out_dim = shape.module_dims(module)
                parent = "self_attn" if module in ATTENTION else "mlp"
                group.append((f"{prefix}{parent}.{module}.weight", (out_dim, in_dim)))
        groups.append(group)
    groups.append([("model.norm.weight", (h,)), ("lm_head.weight", (v, h))])
    return groups


def _random(dims: tuple[int, ...], device: str, generator: torch.Generator) -> torch.Tensor:
    if len(dims) == 1:  # RMSNorm weights
        return torch.ones(dims, dtype=torch.bfloat16, device=device)
    return torch.randn(dims, generator=generator, device=device, dtype=torch.bfloat16).mul_(WEIGHT_STD)


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})


# ---- adapters ----

@dataclass(frozen=True)
class AdapterSpec:
    """One PEFT adapter to write: rank and target modules (every layer)."""

    name: str
    rank: int
    targets: tuple[str, ...] = ATTENTION

    def num_bytes(self, shape: ModelShape) -> int:
        """bf16 bytes of A and B over every layer: what a step reads for this adapter."""
        return 2 * shape.num_layers * sum(self.rank * sum(shape.module_dims(m)) for m in self.targets)


def write_adapters(root: Path, specs: list[AdapterSpec], shape: ModelShape, model_dir: Path, device: str,
                   seed: int = 0) -> dict[str, Path]:
    """Write each adapter under root/<name> (its own seeded generator: the same files for any thread order)."""
    paths = {spec.name: root / spec.name for spec in specs}
    with ThreadPoolExecutor(NUM_WRITERS) as writers:
        jobs = [writers.submit(_write_adapter, paths[spec.name], spec, shape, model_dir, device, seed + 1 + i)
                for i, spec in enumerate(specs)]
        for job in jobs:
            job.result()
    return paths


def _adapter_tensors(spec: AdapterSpec, shape: ModelShape, device: str,
                     generator: torch.Generator) -> dict[str, torch.Tensor]:
    tensors = {}
    for layer in range(shape.num_layers):
        for module in spec.targets:
            in_dim, out_dim = shape.module_dims(module)
            parent = "self_attn" if module in ATTENTION else "mlp"
            key = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{key}.lora_A.weight"] = _random((spec.rank, in_dim), device, generator)
            tensors[f"{key}.lora_B.weight"] = _random((out_dim, spec.rank), device, generator)
    return tensors


def _write_adapter(out: Path, spec: AdapterSpec, shape: ModelShape, model_dir: Path, device: str, seed: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir),
              "r": spec.rank, "lora_alpha": 2 * spec.rank, "target_modules": list(spec.targets),
              "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None, "init_lora_weights": True,
              "inference_mode": True}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    generator = torch.Generator(device=device).manual_seed(seed)
    _save(_adapter_tensors(spec, shape, device, generator), out / "adapter_model.safetensors")
