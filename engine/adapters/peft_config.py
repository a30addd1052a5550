"""A PEFT LoRA adapter_config.json parsed and checked: what the engine reads from it, typed.

Every value is checked before use, since the file comes from a tenant: `r` and `rank_pattern` values are positive
integers, `lora_alpha` and `alpha_pattern` values finite numbers (NaN or infinity: `AdapterCorrupt`), and the
pattern keys are compiled by RE2 (`patterns.py`). A config nested too deep for the JSON parser is corrupt.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from kubelora.engine.adapters.patterns import PatternMap, check_number, compile_patterns
from kubelora.engine.adapters.safetensors_header import json_excerpt
from kubelora.engine.adapters.spec import AdapterLimits
from kubelora.engine.errors import (AdapterBaseModelMismatch, AdapterCorrupt, AdapterRankTooLarge,
                                    AdapterTargetUnsupported, InvalidAdapter)
from kubelora.engine.model.config import MODULE_PARENT

log = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
MAX_CONFIG_BYTES = 1 << 20  # PEFT writes a few KiB
DEFAULT_ALPHA = 8  # PEFT's LoraConfig default
_UNSUPPORTED_FLAGS = ("lora_bias", "use_qalora")  # each changes the math beyond x A^T B^T (and DoRA's scale)
VOCAB_TARGETS = ("embed_tokens", "lm_head")
_UNSUPPORTED_SET = ("modules_to_save", "target_parameters", "trainable_token_indices", "layer_replication")


@dataclass(frozen=True)
class PeftConfig:
    rank: int  # r
    alpha: float  # lora_alpha
    use_rslora: bool
    rank_pattern: PatternMap
    alpha_pattern: PatternMap
    base_model: str  # base_model_name_or_path
    use_dora: bool = False

    def module_rank(self, layer: int, module: str, prefix: str = "model.") -> int:
        """The rank PEFT builds this layer's module with: its rank_pattern entry, else r."""
        return self.rank_pattern.lookup(module_name(layer, module, prefix), self.rank)

    def module_scale(self, layer: int, module: str, prefix: str = "model.") -> float:
        """PEFT's scaling: alpha / r, or alpha / sqrt(r) with rsLoRA, each from its pattern where one matches."""
        alpha = float(self.alpha_pattern.lookup(module_name(layer, module, prefix), self.alpha))
        rank = self.module_rank(layer, module, prefix)
        return alpha / rank**0.5 if self.use_rslora else alpha / rank


def module_name(layer: int, module: str, prefix: str = "model.") -> str:
    """The module's name in the base model, as PEFT matches pattern keys against it. prefix: where the model keeps
    its decoder layers (a multimodal Gemma 3's language model: `model.language_model.`); layer -1: the vocabulary
    modules (`model.embed_tokens`, `lm_head`)."""
    if module == "embed_tokens":
        return f"{prefix}embed_tokens"
    if module == "lm_head":
        return "lm_head"
    return f"{prefix}layers.{layer}.{MODULE_PARENT[module]}.{module}"


def parse_config(name: str, raw: bytes, limits: AdapterLimits) -> PeftConfig:
    config = _load_json(name, raw)
    _check_supported(name, config)
    rank = config.get("r")
    check_number(name, "r", rank, is_rank=True)
    if rank > limits.max_lora_rank:
        raise AdapterRankTooLarge(name, "r", f"rank {rank} exceeds max_lora_rank {limits.max_lora_rank}",
                                  limit=limits.max_lora_rank)
    alpha = config.get("lora_alpha", DEFAULT_ALPHA)
    check_number(name, "lora_alpha", alpha, is_rank=False)
    use_rslora = _flag(name, config, "use_rslora")
    use_dora = _flag(name, config, "use_dora")
    if use_dora and limits.base_format is not None:
        raise InvalidAdapter(name, "use_dora", f"DoRA needs the base weights to norm them; the served base is "
                             f"{limits.base_format}", limit="false")
    _check_targets(name, config.get("target_modules"))
    base_model = str(config.get("base_model_name_or_path") or "")
    _check_base_model(name, base_model, limits)
    return PeftConfig(rank=rank, alpha=alpha, use_rslora=use_rslora, use_dora=use_dora,
                      rank_pattern=compile_patterns(name, "rank_pattern", config.get("rank_pattern"), is_rank=True),
                      alpha_pattern=compile_patterns(name, "alpha_pattern", config.get("alpha_pattern"), is_rank=False),
                      base_model=base_model)


def _flag(name: str, config: dict, key: str) -> bool:
    value = config.get(key) or False  # absent or null: off
    if not isinstance(value, bool):
        raise InvalidAdapter(name, key, f"is {json_excerpt(value)}; it must be true or false", limit="true or false")
    return value


def _load_json(name: str, raw: bytes) -> dict:
    try:
        config = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterCorrupt(name, CONFIG_FILE, f"is not valid JSON ({exc})", limit="a JSON object") from exc
    except RecursionError:
        raise AdapterCorrupt(name, CONFIG_FILE, "is nested too deep to parse", limit="a JSON object") from None
    if not isinstance(config, dict):
        raise AdapterCorrupt(name, CONFIG_FILE, f"must be a JSON object, got {type(config).__name__}",
                             limit="a JSON object")
    return config


def _check_supported(name: str, config: dict) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise InvalidAdapter(name, "peft_type", f"is {json_excerpt(config.get('peft_type'))}", limit="LORA")
    for flag in _UNSUPPORTED_FLAGS:
        if config.get(flag):
            raise InvalidAdapter(name, flag, "is not supported", limit="false")
    for key in _UNSUPPORTED_SET:
        if config.get(key):
            raise InvalidAdapter(name, key, f"is not supported (got {json_excerpt(config[key])})", limit="null")
    if config.get("bias", "none") != "none":
        raise InvalidAdapter(name, "bias", f"is {json_excerpt(config['bias'])}", limit="none")


def _check_targets(name: str, targets: object) -> None:
    if not isinstance(targets, (list, tuple)):
        return  # a regex (or all-linear already resolved by PEFT): the tensor names are checked instead
    if not all(isinstance(t, str) for t in targets):
        raise InvalidAdapter(name, "target_modules", f"must be module names, got {json_excerpt(targets)}",
                             limit="an array of strings")
    adaptable = {*MODULE_PARENT, *VOCAB_TARGETS}
    # PEFT writes a module's short name, or its full name when it resolved "all-linear" (model.layers.0.mlp.up_proj)
    unknown = sorted(t for t in set(targets) if t.rsplit(".", 1)[-1] not in adaptable)  # the rest: on the tensors
    if unknown:
        raise AdapterTargetUnsupported(name, "target_modules", f"{unknown} are not adaptable modules of this "
                                       f"model", limit=sorted(adaptable))


def _check_base_model(name: str, base_model: str, limits: AdapterLimits) -> None:
    base_name = base_model.rstrip("/").rsplit("/", 1)[-1]
    if not base_model or base_name in limits.model_names or base_model in limits.model_names:
        return
    message = f"{base_model!r} differs from the served model {limits.model_names[0]!r}"
    if limits.is_base_model_strict:
        raise AdapterBaseModelMismatch(name, "base_model_name_or_path", message, limit=limits.model_names[0])
    log.warning("adapter %r: base_model_name_or_path %s (shapes match; serving it)", name, message)
