"""The engine benchmark's model directory and PEFT adapters, made from random tensors on the benchmark's device.

A `ModelShape` is a real checkpoint's shape and its family (Llama, Qwen3, Gemma 2, Phi-3/Phi-4: the engine's
family table, engine/model/config.py). `write_model` writes the directory as transformers writes that model type:
config.json from the family's config class, the tensor names and shapes of transformers' own model for that
config (built on the meta device), sharded model.safetensors with its index, a tokenizer. `write_adapter` writes a
PEFT LoRA directory (adapter_config.json, adapter_model.safetensors) with PEFT's key names, targeting the
checkpoint's own modules (Phi's fused qkv_proj and gate_up_proj). Tensors are made on the device and handed to
safetensors from there (it copies each to the host as it writes), so a 7B model takes seconds of GPU time and the
disk's write time, not a host-side init.
"""

from __future__ import annotations

import functools
import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from kubelora.engine.model.config import (FAMILIES, MODULE_PARENT, ModelConfig, engine_modules, load_hf_config,
                                          model_config_from_hf)

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
WEIGHT_STD = 0.02  # transformers' initializer_range for Llama: activations stay finite through 32 layers
SHARD_BYTES = 2 << 30  # layers per shard so that each file is at most about this size
TOKENIZER_BPE_VOCAB = 512  # trained on the shipped corpus; the other ids up to the model's vocab are added tokens
BOS_ID, EOS_ID = 1, 2  # <s> and </s> in the tokenizer (cli/tiny.py's special tokens come first)
NUM_WRITERS = 4  # shards / adapters handed to safetensors at once (device->host copy and disk write overlap)
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class ModelShape:
    """A decoder's sizes and family. What the family's config class fills in by default (Gemma 2's soft-caps,
    query_pre_attn_scalar and alternating sliding layers) is the real checkpoint's, so it is not repeated here."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 4096
    model_type: str = "llama"  # a key of the engine's family table
    explicit_head_dim: int | None = None  # where head_dim is not hidden_size / num_heads (Gemma 2)
    sliding_window: int | None = None  # tokens, on the layers the family's config slides (Gemma 2: every other)
    is_tied: bool = False  # lm_head is the embedding table (tie_word_embeddings)
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelShape.{name} must be >= 1, got {getattr(self, name)}")
        if self.model_type not in FAMILIES:
            raise ValueError(f"ModelShape.model_type must be one of {sorted(FAMILIES)}, got {self.model_type!r}")
        if (self.explicit_head_dim is None and self.hidden_size % self.num_heads) or self.num_heads % self.num_kv_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must divide by num_heads ({self.num_heads}) unless "
                             f"head_dim is explicit, and num_heads by num_kv_heads ({self.num_kv_heads})")
        if self.vocab_size < TOKENIZER_BPE_VOCAB:
            raise ValueError(f"ModelShape.vocab_size must be >= {TOKENIZER_BPE_VOCAB}, got {self.vocab_size}")

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_heads

    def hf_config(self):
        """The transformers config of this shape (its family's class, random-weight checkpoint settings)."""
        return _hf_config(self)

    def model_config(self) -> ModelConfig:
        """The engine's reading of hf_config(): per-layer windows, module sizes (one parser for both)."""
        return model_config_from_hf(self.hf_config(), f"bench-{self.model_type}")

    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer, the sliding window in tokens; None: full attention."""
        return self.model_config().sliding_windows

    def module_dims(self, module: str) -> tuple[int, int]:
        """(in, out) features of one projection: an engine module (q_proj ...) or a checkpoint's fused one."""
        return self.model_config().module_dims(module)

    def peft_modules(self, targets: tuple[str, ...]) -> tuple[str, ...]:
        """The checkpoint's module names a PEFT adapter on the engine modules `targets` targets: themselves, or the
        fused modules holding them (Phi: q, k, v -> qkv_proj). A fused module is adapted whole or not at all."""
        out = []
        for name in FAMILIES[self.model_type].peft_modules:
            parts = set(engine_modules(name))
            if parts & set(targets) and not parts <= set(targets):
                raise ValueError(f"targets {targets} split {name} ({', '.join(sorted(parts))}): adapt all or none")
            if parts <= set(targets):
                out.append(name)
        return tuple(out)

    def tensors(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """Every tensor of the checkpoint, name and shape, in transformers' order (a tied lm_head not saved)."""
        return _tensors(self)

    def checkpoint_bytes(self) -> int:
        """bf16 bytes of the checkpoint's tensors."""
        return 2 * sum(_numel(dims) for _, dims in self.tensors())

    def as_dict(self) -> dict:
        return asdict(self)


def _numel(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


@functools.lru_cache(maxsize=16)
def _hf_config(shape: ModelShape):
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kwargs = dict(hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
                  num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
                  num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim, vocab_size=shape.vocab_size,
                  max_position_embeddings=shape.max_position_embeddings, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                  pad_token_id=EOS_ID, tie_word_embeddings=shape.is_tied,
                  rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta})
    if shape.model_type == "llama":
        kwargs["rms_norm_eps"] = 1e-5
    if shape.model_type == "phi3":  # the long-context switch at the model's own length: never crossed
        kwargs["original_max_position_embeddings"] = shape.max_position_embeddings
    if shape.sliding_window is not None:  # Qwen3 slides only when asked to
        kwargs.update(sliding_window=shape.sliding_window, use_sliding_window=True)
    config = AutoConfig.for_model(shape.model_type, **kwargs)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[shape.model_type]]
    return config


@functools.lru_cache(maxsize=16)
def _tensors(shape: ModelShape) -> tuple[tuple[str, tuple[int, ...]], ...]:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape.hf_config(), dtype=torch.bfloat16)
    return tuple((name, tuple(p.shape)) for name, p in model.named_parameters())  # a tied lm_head is the embedding


SHAPES = {
    "7b": ModelShape(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32, intermediate_size=11008,
                     vocab_size=32000),  # Llama-2-7B
    "8b": ModelShape(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, intermediate_size=14336,
                     vocab_size=128256, max_position_embeddings=131072),  # Llama-3.1-8B (GQA: 128 KiB of KV a token)
    # The other families' checkpoints (config.json of each; docs/benchmarks-engine.md, "Model families").
    "qwen3-8b": ModelShape(hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8, intermediate_size=12288,
                           vocab_size=151936, max_position_embeddings=40960, model_type="qwen3", rope_theta=1e6),
    "gemma2-9b": ModelShape(hidden_size=3584, num_layers=42, num_heads=16, num_kv_heads=8, intermediate_size=14336,
                            vocab_size=256000, max_position_embeddings=8192, model_type="gemma2",
                            explicit_head_dim=256, sliding_window=4096, is_tied=True),
    "phi4": ModelShape(hidden_size=5120, num_layers=40, num_heads=40, num_kv_heads=10, intermediate_size=17920,
                       vocab_size=100352, max_position_embeddings=16384, model_type="phi3", rope_theta=250000.0),
    "tiny": ModelShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                       vocab_size=512, max_position_embeddings=2048),
}
# Each family's shape at tiny sizes (CPU runs and tests): the same family, head_dim and tying, windows of 8 tokens
# so that a smoke run's prompts cross them.
SHAPES.update({f"tiny-{name}": replace(SHAPES["tiny"], num_layers=4, model_type=SHAPES[name].model_type,
                                       explicit_head_dim=32 if SHAPES[name].explicit_head_dim else None,
                                       sliding_window=8 if SHAPES[name].sliding_window else None,
                                       is_tied=SHAPES[name].is_tied, rope_theta=SHAPES[name].rope_theta)
               for name in ("qwen3-8b", "gemma2-9b", "phi4")})


def shape_of(model_dir: Path) -> ModelShape:
    """The shape of an existing Hugging Face directory of a family the engine serves (config.json)."""
    hf = load_hf_config(model_dir)
    config = model_config_from_hf(hf, model_dir)
    windows = {w for w in config.sliding_windows if w is not None}
    return ModelShape(hidden_size=config.hidden_size, num_layers=config.num_layers, num_heads=config.num_heads,
                      num_kv_heads=config.num_kv_heads, intermediate_size=config.intermediate_size,
                      vocab_size=config.vocab_size, max_position_embeddings=config.max_position_embeddings,
                      model_type=config.model_type,
                      explicit_head_dim=None if config.head_dim * config.num_heads == config.hidden_size
                      else config.head_dim,
                      sliding_window=max(windows) if windows else None, is_tied=config.tie_word_embeddings,
                      rope_theta=float(_rope_theta(hf)))


def _rope_theta(hf) -> float:
    """The RoPE base of a config with one RoPE for every layer (transformers 5's rope_parameters, or the older
    rope_theta); the default base otherwise."""
    params = getattr(hf, "rope_parameters", None) or {}
    return params.get("rope_theta") or getattr(hf, "rope_theta", None) or 10000.0


def with_overrides(shape: ModelShape, **sizes: int | None) -> ModelShape:
    return replace(shape, **{k: v for k, v in sizes.items() if v is not None})


# ---- model ----

def write_model(out: Path, shape: ModelShape, device: str, seed: int = 0) -> Path:
    """A random bf16 directory of `shape`'s family; returns `out`."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(shape.vocab_size)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (BOS_ID, EOS_ID)
    tokenizer.save_pretrained(out)
    shape.hf_config().save_pretrained(out)
    generator = torch.Generator(device=device).manual_seed(seed)
    is_offset = FAMILIES[shape.model_type].is_unit_offset_norm
    groups = _shard_groups(shape)
    weight_map, total = {}, 0
    with ThreadPoolExecutor(NUM_WRITERS) as writers:
        jobs = []
        for index, group in enumerate(groups):
            name = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
            tensors = {key: _random(key, dims, is_offset, device, generator) for key, dims in group}
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


def _shard_groups(shape: ModelShape) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Tensor names and shapes, grouped into shards: what precedes the layers (the embeddings), runs of whole
    layers, then what follows them (the final norm, an untied lm_head)."""
    layers: dict[int, list] = {}
    before, after = [], []
    for name, dims in shape.tensors():
        found = _LAYER.match(name)
        if found:
            layers.setdefault(int(found[1]), []).append((name, dims))
        else:
            (after if layers else before).append((name, dims))
    layer_bytes = 2 * sum(_numel(dims) for _, dims in layers[0])
    per_shard = max(1, SHARD_BYTES // layer_bytes)
    runs = [sum((layers[i] for i in range(start, min(start + per_shard, shape.num_layers))), [])
            for start in range(0, shape.num_layers, per_shard)]
    return [before, *runs, after]


def _random(name: str, dims: tuple[int, ...], is_offset_norm: bool, device: str,
            generator: torch.Generator) -> torch.Tensor:
    if len(dims) == 1:  # RMSNorm weights at their identity (Gemma's scale by 1 + w), biases at zero
        is_one = name.endswith("norm.weight") and not is_offset_norm
        return (torch.ones if is_one else torch.zeros)(dims, dtype=torch.bfloat16, device=device)
    return torch.randn(dims, generator=generator, device=device, dtype=torch.bfloat16).mul_(WEIGHT_STD)


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})


# ---- adapters ----

@dataclass(frozen=True)
class AdapterSpec:
    """One PEFT adapter to write: rank and target engine modules (every layer); on a checkpoint with fused modules
    it targets those that hold them (ModelShape.peft_modules)."""

    name: str
    rank: int
    targets: tuple[str, ...] = ATTENTION

    def num_bytes(self, shape: ModelShape) -> int:
        """bf16 bytes of A and B over every layer: what a step reads for this adapter (a fused module's one A)."""
        return 2 * shape.num_layers * sum(self.rank * sum(shape.module_dims(m))
                                          for m in shape.peft_modules(self.targets))


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
        for module in shape.peft_modules(spec.targets):
            in_dim, out_dim = shape.module_dims(module)
            key = f"base_model.model.model.layers.{layer}.{MODULE_PARENT[module]}.{module}"
            tensors[f"{key}.lora_A.weight"] = _random("lora_A", (spec.rank, in_dim), False, device, generator)
            tensors[f"{key}.lora_B.weight"] = _random("lora_B", (out_dim, spec.rank), False, device, generator)
    return tensors


def _write_adapter(out: Path, spec: AdapterSpec, shape: ModelShape, model_dir: Path, device: str, seed: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir),
              "r": spec.rank, "lora_alpha": 2 * spec.rank, "target_modules": list(shape.peft_modules(spec.targets)),
              "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None, "init_lora_weights": True,
              "inference_mode": True}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    generator = torch.Generator(device=device).manual_seed(seed)
    _save(_adapter_tensors(spec, shape, device, generator), out / "adapter_model.safetensors")
