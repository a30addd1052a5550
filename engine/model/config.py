"""The decoder's shape, parsed once from a Hugging Face config.json, and the table of model families it serves.

Every family is the Llama decoder with a few switches (`Family`): how RMSNorm applies its weight, per-head q/k
norms, norms on the sublayer outputs, the MLP's activation, scaled embeddings, and the checkpoint's names for the
fused projections. The numbers that vary within a family (attention scale, soft-caps, per-layer windows and RoPE
bases) are read from the config into `ModelConfig`. A config this engine cannot serve is refused here, at
start-up, with the field and what is supported. So is a `quantization_config` other than the FP8 formats of
`Fp8Quantization` (engine/model/quantized.py serves them).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# RoPE variants with one set of inverse frequencies for the engine's life (longrope: see `rope_inv_freq`).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
FULL, SLIDING = "full_attention", "sliding_attention"

# The adaptable linear layers: engine module name -> (projection kind it is fused into, slice index).
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
# Checkpoints that store a kind as one fused module (Phi-3): its name -> the engine modules it holds, in output
# order. PEFT adapters of such a model target the fused module: one lora_A for all of them, one lora_B spanning them.
FUSED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# Where each module lives inside a decoder layer, in HF (and PEFT) names.
MODULE_PARENT = {
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "qkv_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "gate_up_proj": "mlp", "down_proj": "mlp",
}
SEPARATE_CHECKPOINT = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                       "o": ("self_attn.o_proj",),
                       "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
                       "down": ("mlp.down_proj",)}
FUSED_CHECKPOINT = {"qkv": ("self_attn.qkv_proj",), "o": ("self_attn.o_proj",), "gate_up": ("mlp.gate_up_proj",),
                    "down": ("mlp.down_proj",)}


def engine_modules(peft_module: str) -> tuple[str, ...]:
    """The engine modules a PEFT module's adapter weights go to: itself, or those a fused module holds."""
    return FUSED_MODULES.get(peft_module, (peft_module,))


@dataclass(frozen=True)
class Family:
    """What a model family changes in the Llama decoder layer."""

    activation: str = "silu"  # the MLP's gate activation (transformers' name): silu x up, or GeGLU
    is_unit_offset_norm: bool = False  # RMSNorm scales by (1 + w) in float32, rounded once after (Gemma)
    has_qk_norm: bool = False  # RMSNorm over head_dim of each q and k head, before RoPE (Qwen3, Gemma 3)
    has_post_norms: bool = False  # RMSNorm on the attention and MLP outputs, before each residual add (Gemma)
    is_embed_scaled: bool = False  # embeddings x sqrt(hidden_size), the factor rounded to the dtype (Gemma)
    checkpoint: dict[str, tuple[str, ...]] = field(default_factory=lambda: SEPARATE_CHECKPOINT)  # kind -> HF modules

    @property
    def peft_modules(self) -> tuple[str, ...]:
        """The module names PEFT adapters of this family target (the checkpoint's own linear layers)."""
        return tuple(name.split(".")[1] for names in self.checkpoint.values() for name in names)


_GEMMA = dict(activation="gelu_pytorch_tanh", is_unit_offset_norm=True, has_post_norms=True, is_embed_scaled=True)
FAMILIES = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(),
    "qwen3": Family(has_qk_norm=True),
    "gemma2": Family(**_GEMMA),
    "gemma3_text": Family(**_GEMMA, has_qk_norm=True),
    "phi3": Family(checkpoint=FUSED_CHECKPOINT),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)

# FP8 base checkpoints served (engine/model/quantized.py), as quantization_config says them
WEIGHT_STRATEGIES = ("tensor", "channel", "block")  # one scale per tensor, per output row, per weight block
ACTIVATION_SCHEMES = ("dynamic-token", "dynamic-group", "static-tensor")  # how the GPU path quantizes inputs
SUPPORTED_QUANTIZATION = ("compressed-tensors format 'float-quantized': 8-bit float weights per tensor, channel or "
                          "block, activations 8-bit float dynamic per token or token group or static per tensor; "
                          "quant_method 'fp8' (e4m3) with weight_block_size and dynamic activations")


@dataclass(frozen=True)
class Fp8Quantization:
    """An FP8 base checkpoint's scheme, from its config.json's quantization_config (one scheme for every quantized
    linear layer). Weights are float8_e4m3fn with float scales (dequantized w = q * scale) in `scale_name`."""

    method: str  # "compressed-tensors" or "fp8" (transformers' fine-grained FP8)
    weight_strategy: str  # one of WEIGHT_STRATEGIES
    weight_block: tuple[int, int] | None  # (rows, cols) of a weight block: the block strategy only
    # one of ACTIVATION_SCHEMES: how the checkpoint says the matmul's input is quantized (dynamic-group: per token
    # and weight block of columns)
    activations: str
    ignore: tuple[str, ...] = ()  # modules kept unquantized: names, or "re:" + a regular expression

    def __post_init__(self) -> None:
        if self.weight_strategy not in WEIGHT_STRATEGIES:
            raise ValueError(f"weight strategy must be one of {WEIGHT_STRATEGIES}, got {self.weight_strategy!r}")
        if (self.weight_block is not None) != (self.weight_strategy == "block"):
            raise ValueError("a weight block size is given exactly for the block strategy")
        if self.activations not in ACTIVATION_SCHEMES:
            raise ValueError(f"activations must be one of {ACTIVATION_SCHEMES}, got {self.activations!r}")

    @property
    def scale_name(self) -> str:
        """The suffix of a quantized module's weight scale tensor (both formats multiply by it)."""
        return "weight_scale_inv" if self.method == "fp8" else "weight_scale"

    @property
    def name(self) -> str:
        """The format as the model card and metrics say it, e.g. "fp8-channel-dynamic-token"."""
        block = f"{self.weight_block[0]}x{self.weight_block[1]}" if self.weight_block else ""
        return f"fp8-{self.weight_strategy}{block}-{self.activations}"

    def is_quantized(self, module: str) -> bool:
        """Whether a checkpoint module (e.g. "model.layers.0.mlp.down_proj") is stored FP8: every linear layer the
        ignore list does not name (compressed-tensors' matching: a name, or "re:" and a pattern matched at its
        start)."""
        return not any(re.match(entry[3:], module) if entry.startswith("re:") else entry == module
                       for entry in self.ignore)


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
    # per layer, the key of its RoPE parameters where they differ by layer type (Gemma 3: FULL or SLIDING); empty:
    # one RoPE for every layer
    rope_types: tuple[str, ...] = ()
    query_pre_attn_scalar: float | None = None  # attention scores scaled by its -0.5 power (None: head_dim's)
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap), before the mask
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    quantization: Fp8Quantization | None = None  # None: the base weights are stored in a float dtype

    def __post_init__(self) -> None:
        check_model_type(self.model_type)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")
        if self.hidden_act != self.family.activation:
            raise ValueError(f"hidden_act must be {self.family.activation!r} for {self.model_type}, got "
                             f"{self.hidden_act!r}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE rotates halves), got {self.head_dim}")
        if len(self.sliding_windows) != self.num_layers:
            raise ValueError(f"sliding_windows must have num_hidden_layers ({self.num_layers}) entries, got "
                             f"{len(self.sliding_windows)}")

    @property
    def family(self) -> Family:
        return FAMILIES[self.model_type]

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def module_dims(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of an adaptable linear layer (an engine module or a fused one)."""
        if module in FUSED_MODULES:
            dims = [self.module_dims(m) for m in FUSED_MODULES[module]]
            return dims[0][0], sum(out for _, out in dims)
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
        """The engine modules fused into one projection kind, in slice order."""
        return tuple(m for m, (k, _) in sorted(LORA_MODULES.items(), key=lambda kv: kv[1][1]) if k == kind)


def load_hf_config(model_dir: str | Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir))


def text_config(hf_config):
    """The language model's config: a multimodal Gemma 3 checkpoint's text_config (its vision tower is not
    served), else the config itself."""
    if hf_config.model_type == "gemma3":
        return hf_config.text_config
    return hf_config


def model_config_from_hf(hf_config, model_dir: str | Path) -> ModelConfig:
    text = text_config(hf_config)
    if text is not hf_config:
        log.info("%s is a multimodal gemma3 checkpoint: serving its language model only (the vision tower is not "
                 "loaded; image inputs are not accepted)", Path(model_dir).name)
    _check_supported(text)
    num_heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    eos = hf_config.eos_token_id if getattr(hf_config, "eos_token_id", None) is not None else text.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    return ModelConfig(
        model_type=text.model_type,
        name=Path(model_dir).resolve().name,
        num_layers=text.num_hidden_layers,
        hidden_size=text.hidden_size,
        num_heads=num_heads,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        intermediate_size=text.intermediate_size,
        vocab_size=text.vocab_size,
        max_position_embeddings=text.max_position_embeddings,
        rms_norm_eps=text.rms_norm_eps,
        hidden_act=_activation(text),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)
                                 or getattr(text, "tie_word_embeddings", False)),
        sliding_windows=_sliding_windows(text),
        eos_token_ids=eos_ids,
        rope_types=tuple(_layer_types(text)) if _is_rope_per_layer_type(text) else (),
        query_pre_attn_scalar=getattr(text, "query_pre_attn_scalar", None),
        attn_logit_softcap=getattr(text, "attn_logit_softcapping", None),
        final_logit_softcap=getattr(text, "final_logit_softcapping", None),
        quantization=quantization_from_hf(hf_config),
    )


def quantization_from_hf(hf_config) -> Fp8Quantization | None:
    """The checkpoint's FP8 scheme from quantization_config (None without one); any other format, scheme or
    strategy refused naming the field, what it holds and what is served."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(qc)
    if method == "fp8":
        return _fine_grained_fp8_scheme(qc)
    _refuse_quantization("quantization_config.quant_method", method)


def _refuse_quantization(field_name: str, value) -> None:
    raise ValueError(f"{field_name} {value!r} is not served; served FP8 base checkpoints: {SUPPORTED_QUANTIZATION}")


def _compressed_tensors_scheme(qc: dict) -> Fp8Quantization:
    """compressed-tensors' float-quantized format: one scheme (weights, input_activations) over config_groups."""
    if qc.get("format") != "float-quantized":
        _refuse_quantization("quantization_config.format", qc.get("format"))
    groups = qc.get("config_groups") or {}
    schemes = {(_freeze(g.get("weights")), _freeze(g.get("input_activations"))) for g in groups.values()}
    if len(schemes) != 1:
        _refuse_quantization("quantization_config.config_groups (one scheme for every group)",
                             [{"weights": g.get("weights"), "input_activations": g.get("input_activations")}
                              for g in groups.values()])
    group = next(iter(groups.values()))
    for key in ("kv_cache_scheme", "transform_config", "sparsity_config"):
        if qc.get(key):
            _refuse_quantization(f"quantization_config.{key}", qc[key])
    if "Linear" not in group.get("targets", ()):
        _refuse_quantization("quantization_config.config_groups.*.targets (must hold 'Linear')", group.get("targets"))
    weights, inputs = group.get("weights") or {}, group.get("input_activations") or {}
    _check_fp8_args("weights", weights)
    strategy = weights.get("strategy")
    if strategy not in WEIGHT_STRATEGIES or weights.get("dynamic"):
        _refuse_quantization("quantization_config.config_groups.*.weights.strategy (static)", strategy)
    block = tuple(weights["block_structure"]) if strategy == "block" else None
    _check_fp8_args("input_activations", inputs)
    activations = {(True, "token"): "dynamic-token", (True, "group"): "dynamic-group",
                   (False, "tensor"): "static-tensor"}.get((bool(inputs.get("dynamic")), inputs.get("strategy")))
    if activations is None:
        _refuse_quantization("quantization_config.config_groups.*.input_activations (dynamic, strategy)",
                             (inputs.get("dynamic"), inputs.get("strategy")))
    if activations == "dynamic-group" and (block is None or inputs.get("group_size") != block[1]):
        _refuse_quantization("quantization_config.config_groups.*.input_activations.group_size (a weight block's "
                             "width, with block weights)", (inputs.get("group_size"), block))
    scheme = Fp8Quantization("compressed-tensors", strategy, block, activations, tuple(qc.get("ignore") or ()))
    if scheme.is_quantized("lm_head"):  # its adapters' deltas add to bf16 logits; checkpoints keep it unquantized
        _refuse_quantization("quantization_config.ignore (must list lm_head: a quantized lm_head)", list(scheme.ignore))
    return scheme


def _check_fp8_args(role: str, args: dict) -> None:
    """Symmetric 8-bit float (e4m3) quantization arguments, nothing else."""
    if args.get("num_bits") != 8 or args.get("type") != "float" or not args.get("symmetric", True):
        _refuse_quantization(f"quantization_config.config_groups.*.{role} (num_bits, type, symmetric)",
                             (args.get("num_bits"), args.get("type"), args.get("symmetric")))
    for key in ("actorder", "scale_dtype", "zp_dtype"):
        if args.get(key) not in (None, "float32", "torch.float32"):
            _refuse_quantization(f"quantization_config.config_groups.*.{role}.{key}", args[key])


def _fine_grained_fp8_scheme(qc: dict) -> Fp8Quantization:
    """transformers' fine-grained FP8 (quant_method "fp8"): e4m3 weights in weight_block_size blocks with their
    weight_scale_inv (multiplied to dequantize), inputs quantized per token and group of block columns."""
    block = qc.get("weight_block_size")
    if not block or len(block) != 2:
        _refuse_quantization("quantization_config.weight_block_size (two block sizes)", block)
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        _refuse_quantization("quantization_config.activation_scheme", qc.get("activation_scheme"))
    if qc.get("fmt", "e4m3") != "e4m3" or qc.get("scale_fmt", "float") != "float":
        _refuse_quantization("quantization_config.fmt / scale_fmt", (qc.get("fmt"), qc.get("scale_fmt")))
    if qc.get("modules_to_convert"):
        _refuse_quantization("quantization_config.modules_to_convert (every linear layer but those not converted)",
                             qc["modules_to_convert"])
    # transformers never converts the output embedding (get_keys_to_not_convert)
    ignore = (*(qc.get("modules_to_not_convert") or ()), "lm_head")
    return Fp8Quantization("fp8", "block", (block[0], block[1]), "dynamic-group", ignore)


def _freeze(args: dict | None) -> str:
    return json.dumps(args or {}, sort_keys=True)


def check_model_type(model_type: str) -> None:
    if model_type not in FAMILIES:
        raise ValueError(f"model_type must be one of {SUPPORTED_MODEL_TYPES} (gemma3: served text-only), got "
                         f"{model_type!r}")


def _check_supported(text) -> None:
    """Refuse what the decoder does not compute, naming the field (the families' variants it does not serve); the
    model_type first, before any field a foreign config may not have."""
    check_model_type(text.model_type)
    if getattr(text, "use_bidirectional_attention", None):
        raise ValueError("use_bidirectional_attention must be false or null: the engine serves causal decoders")
    for params in _rope_parameter_sets(text):
        partial = params.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", None)) or 1.0
        if partial != 1.0:
            raise ValueError(f"rope_parameters.partial_rotary_factor must be 1.0 (RoPE over the whole head), got "
                             f"{partial}")
    unknown = set(_layer_types(text)) - {FULL, SLIDING}
    if unknown:
        raise ValueError(f"layer_types must hold only {FULL!r} and {SLIDING!r}, got {sorted(unknown)}")


def _activation(text) -> str:
    """hidden_activation (Gemma's name) or hidden_act; refused unless it is the family's (ModelConfig checks)."""
    act = getattr(text, "hidden_activation", None) or getattr(text, "hidden_act", None)
    if act not in ACTIVATIONS:
        raise ValueError(f"hidden_act (or hidden_activation) must be one of {ACTIVATIONS}, got {act!r}")
    return act


def _layer_types(text) -> list[str]:
    """FULL or SLIDING per layer: the config's layer_types where it has them, else every layer alike."""
    layer_types = getattr(text, "layer_types", None)
    if layer_types:
        return list(layer_types)
    kind = SLIDING if getattr(text, "sliding_window", None) else FULL
    return [kind] * text.num_hidden_layers


def _sliding_windows(text) -> tuple[int | None, ...]:
    window = getattr(text, "sliding_window", None)
    return tuple(window if t == SLIDING else None for t in _layer_types(text))


def _is_rope_per_layer_type(text) -> bool:
    params = getattr(text, "rope_parameters", None) or {}
    return any(isinstance(params.get(t), dict) for t in (FULL, SLIDING))


def _rope_parameter_sets(text) -> list[dict]:
    params = dict(getattr(text, "rope_parameters", None) or {})
    if _is_rope_per_layer_type(text):
        return [params[t] for t in (FULL, SLIDING) if t in params]
    return [params]


def rope_inv_freq(hf_config, max_model_len: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32, attention scaling of cos/sin), exactly as transformers computes them.

    layer_type: the key of per-layer-type RoPE parameters (Gemma 3), else None. longrope (Phi-3's long-context
    variants) has two sets of frequencies, and transformers uses the long one for a sequence once it is longer than
    original_max_position_embeddings (re-encoding the cache at the switch). The engine picks one set for its life,
    from max_model_len: the short one when max_model_len <= original_max_position_embeddings (every sequence as
    transformers computes it), else the long one (sequences past the switch as transformers computes them; shorter
    ones with the long factors too). One set keeps the KV cache consistent and the graphs static.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    text = text_config(hf_config)
    params = dict(getattr(text, "rope_parameters", None) or {})
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_parameters.rope_type must be one of {SUPPORTED_ROPE_TYPES}, got {rope_type!r}")
    if rope_type == "longrope":
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](text, torch.device("cpu"), seq_len=max_model_len)
        return inv_freq.float(), float(scaling)
    if rope_type != "default":
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](text, torch.device("cpu"), layer_type=layer_type)
        return inv_freq.float(), float(scaling)
    base = params.get("rope_theta", getattr(text, "rope_theta", 10000.0))
    dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return inv_freq, 1.0
