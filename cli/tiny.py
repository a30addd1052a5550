"""Tiny Hugging Face models and PEFT adapters, made here with the real libraries (no model hub exists here).

`make_tiny_model` writes config.json, model.safetensors, tokenizer.json and tokenizer_config.json (with a chat
template) for a randomly initialised Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 (text) or Phi-3; `make_adapter`
writes a PEFT LoRA adapter with PEFT's own `save_pretrained`. Both are deterministic for a seed. The newer families
have small sliding windows (8 tokens) so that short prompts cross them, and their distinguishing features switched
on (explicit head_dim, soft-caps, per-layer RoPE, longrope).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3")
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_LINEAR_TARGETS = ATTENTION_TARGETS + ("gate_proj", "up_proj", "down_proj")
FUSED_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # Phi-3's linear layers
ZERO_CENTRED_NORMS = ("gemma2", "gemma3_text")  # RMSNorm weights stored as w with the scale 1 + w
WINDOW = 8  # sliding window of the newer families' tiny models
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
BOS, EOS = "<s>", "</s>"
# A minimal chat format: one header token per role, `<|end|>` closes each turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    arch: str = "llama"
    seed: int = 0
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = 512
    max_position_embeddings: int = 512

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.vocab_size < 300:
            raise ValueError(f"vocab_size must be >= 300 (256 bytes + specials + merges), got {self.vocab_size}")


def build_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained on the corpus shipped with kubelora, wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = resources.files("kubelora.cli").joinpath("data/corpus.txt").read_text().splitlines()
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        unk_token="<unk>",
        pad_token=EOS,
        chat_template=CHAT_TEMPLATE,
    )


def build_config(spec: TinyModelSpec, tokenizer):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        # Larger than the usual 0.02 so that tiny random models have peaked logits (no greedy near-ties).
        initializer_range=0.25,
    )
    if spec.arch == "llama":
        # Llama-3 rope scaling, with an original context short enough that the scaling changes the numbers.
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        return LlamaConfig(**common, rope_parameters=rope)
    if spec.arch == "mistral":
        return MistralConfig(**common, sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if spec.arch == "qwen2":
        return Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    return _family_config(spec, common)


def _family_config(spec: TinyModelSpec, common: dict):
    """Qwen3, Gemma 2, Gemma 3 text and Phi-3 with what sets each apart from Llama exercised."""
    from transformers import Gemma2Config, Gemma3TextConfig, Phi3Config, Qwen3Config

    head_dim = 2 * spec.hidden_size // spec.num_heads  # independent of hidden / heads
    if spec.arch == "qwen3":  # layer 0 full, the rest sliding
        return Qwen3Config(**common, head_dim=head_dim, use_sliding_window=True, sliding_window=WINDOW,
                           max_window_layers=1, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if spec.arch == "gemma2":  # sliding and full layers alternate; soft-caps small enough to bite
        return Gemma2Config(**common, head_dim=head_dim, query_pre_attn_scalar=24, sliding_window=WINDOW,
                            attn_logit_softcapping=5.0, final_logit_softcapping=8.0)
    if spec.arch == "gemma3_text":  # every third layer full, with its own RoPE base and a linear scaling
        layer_types = ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(spec.num_layers)]
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}
        return Gemma3TextConfig(**common, head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=WINDOW,
                                layer_types=layer_types, rope_parameters=rope)
    half = spec.hidden_size // spec.num_heads // 2  # phi3: head_dim = hidden / heads; longrope past 32 positions
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [2.0 + 0.5 * i for i in range(half)]}
    return Phi3Config(**common, sliding_window=WINDOW, original_max_position_embeddings=32, rope_parameters=rope,
                      pad_token_id=common["eos_token_id"])


def _perturb_defaults(model: torch.nn.Module, generator: torch.Generator) -> None:
    """transformers initialises norms to 1 (Gemma's to 0, scaling by 1 + w) and biases to 0; random values make the
    tests see them."""
    centre = 0.0 if model.config.model_type in ZERO_CENTRED_NORMS else 1.0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(centre + 0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))


def _quiet_transformers() -> None:
    """Progress bars and deprecation chatter from transformers would drown the CLI's one-line output."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")


def make_tiny_model(out_dir: str | Path, arch: str = "llama", seed: int = 0, **sizes: int) -> Path:
    """Write a random tiny `arch` model with its tokenizer to `out_dir`; return the directory."""
    from transformers import AutoModelForCausalLM

    spec = TinyModelSpec(arch=arch, seed=seed, **sizes)
    _quiet_transformers()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.vocab_size)
    config = build_config(spec, tokenizer)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb_defaults(model, torch.Generator().manual_seed(spec.seed + 1))
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _pin_chat_template(out)
    _make_world_readable(out)
    return out


def _make_world_readable(out: Path) -> None:
    """safetensors writes its files 0600; the images run as the non-root uid 65532 (images/*/Dockerfile), and a
    model or adapter mounted into a pod must be readable by it."""
    for path in (out, *out.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _pin_chat_template(out: Path) -> None:
    """Keep the chat template inside tokenizer_config.json too, where older readers look for it."""
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(config, indent=2) + "\n")


def parse_targets(targets: str | list[str] | tuple[str, ...], arch: str = "llama") -> list[str]:
    """Module names of `arch`'s layers (Phi-3's fused qkv_proj and gate_up_proj), or all-linear: all of them."""
    known = FUSED_TARGETS if arch == "phi3" else ALL_LINEAR_TARGETS
    if isinstance(targets, str):
        if targets == "all-linear":
            return list(known)
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    unknown = sorted(set(targets) - set(known))
    if unknown or not targets:
        raise ValueError(f"targets must be a subset of {','.join(known)} or 'all-linear', got {targets}")
    return list(targets)


def make_adapter(
    out_dir: str | Path,
    model_dir: str | Path,
    rank: int = 8,
    alpha: float = 16,
    targets: str | list[str] = ",".join(ATTENTION_TARGETS),
    seed: int = 0,
    use_rslora: bool = False,
) -> Path:
    """Write a PEFT LoRA adapter for the model in `model_dir`, with random non-zero A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    _quiet_transformers()
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=parse_targets(targets, base.config.model_type),
                        lora_dropout=0.0, use_rslora=use_rslora, task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                # PEFT starts B at zero (the adapter is a no-op); a served adapter must change the output.
                param.copy_(0.3 * torch.randn(param.shape, generator=generator) / rank**0.5)
    out = Path(out_dir)
    model.save_pretrained(out)
    _make_world_readable(out)
    return out
