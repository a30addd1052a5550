"""Read and validate PEFT LoRA adapters (adapter_config.json + adapter_model.safetensors).

`read_adapter_spec` reads the config and the safetensors header only (nothing resident); `read_adapter_weights`
reads the tensors into host memory. Every failure is a typed `InvalidAdapter` naming the adapter, the field
and the limit; nothing here touches engine state.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from kubelora.engine.adapters.safetensors_header import WEIGHTS_FILE, json_excerpt, read_header
from kubelora.engine.adapters.spec import AdapterLimits, AdapterSpec, HostAdapter
from kubelora.engine.errors import (
    AdapterChanged,
    AdapterBaseModelMismatch,
    AdapterCorrupt,
    AdapterNotFound,
    AdapterRankTooLarge,
    AdapterShapeMismatch,
    AdapterTargetUnsupported,
    AdapterTooLarge,
    InvalidAdapter,
)
from kubelora.engine.model.config import LORA_MODULES, MODULE_PARENT, ModelConfig

log = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
ALLOWED_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
MAX_CONFIG_BYTES = 1 << 20  # PEFT writes a few KiB
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(?P<layer>\d+)\.(?P<parent>self_attn|mlp)\."
    r"(?P<module>\w+)\.lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight$"
)
_UNSUPPORTED_FLAGS = ("use_dora", "lora_bias", "use_qalora")  # each changes the math beyond x A^T B^T
_UNSUPPORTED_SET = ("modules_to_save", "target_parameters", "trainable_token_indices", "layer_replication")


def read_adapter_spec(name: str, path: str | Path, model: ModelConfig, limits: AdapterLimits) -> AdapterSpec:
    root = Path(path)
    if not root.is_dir():
        raise AdapterNotFound(name, "path", f"{str(root)!r} is not a directory", limit="an adapter directory")
    config_bytes = _read_config(name, root / CONFIG_FILE)
    config = _parse_config(name, config_bytes)
    weights_file = root / WEIGHTS_FILE
    header, num_weight_bytes = read_header(name, weights_file)
    _check_config(name, config, limits)
    tensor_names, shapes = _index_tensors(name, header, model)
    ranks = _module_ranks(name, tensor_names, shapes, model, limits)
    return AdapterSpec(
        name=name,
        path=str(root),
        revision=_revision(name, config_bytes, weights_file, num_weight_bytes),
        num_weight_bytes=num_weight_bytes,
        ranks=ranks,
        scales=_module_scales(name, config, tensor_names, shapes),
        tensor_names=tensor_names,
        base_model=str(config.get("base_model_name_or_path") or ""),
        use_rslora=bool(config.get("use_rslora")),
    )


def read_adapter_weights(spec: AdapterSpec, model: ModelConfig, dtype: torch.dtype, pin: bool) -> HostAdapter:
    """Read the tensors (one file read), check they still hash to spec.revision, lay them out per module."""
    root = Path(spec.path)
    config_bytes = _read_config(spec.name, root / CONFIG_FILE)
    # Never more than the registered size: bytes appended since registration are not read.
    data = _read_file(spec.name, root / WEIGHTS_FILE, spec.num_weight_bytes + 1)
    if len(data) != spec.num_weight_bytes or _revision_of_bytes(config_bytes, data) != spec.revision:
        raise AdapterChanged(spec.name, f"files under {spec.path} changed since revision {spec.revision} was "
                                        "registered; load it again with load_inplace")
    try:
        tensors = load_safetensors(data)
    except Exception as exc:  # safetensors raises its own error types for corrupt payloads
        raise AdapterCorrupt(spec.name, WEIGHTS_FILE, f"cannot be parsed: {exc}", limit="a safetensors file") from exc
    a, b = {}, {}
    for module, rank in spec.ranks.items():
        in_dim, out_dim = model.module_dims(module)
        a[module] = torch.zeros(model.num_layers, rank, in_dim, dtype=dtype)
        b[module] = torch.zeros(model.num_layers, rank, out_dim, dtype=dtype)
    for (layer, module), (a_key, b_key) in spec.tensor_names.items():
        lora_a, lora_b = tensors[a_key], tensors[b_key]
        a[module][layer, : lora_a.shape[0]] = lora_a.to(dtype)
        b[module][layer, : lora_b.shape[1]] = lora_b.T.to(dtype)
    if pin:
        a = {m: t.pin_memory() for m, t in a.items()}
        b = {m: t.pin_memory() for m, t in b.items()}
    return HostAdapter(a=a, b=b)


def _read_config(name: str, path: Path) -> bytes:
    data = _read_file(name, path, MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise InvalidAdapter(name, CONFIG_FILE, f"is larger than {MAX_CONFIG_BYTES} bytes",
                             limit=f"<= {MAX_CONFIG_BYTES} bytes")
    return data


def _read_file(name: str, path: Path, max_bytes: int) -> bytes:
    """At most `max_bytes` of the file."""
    try:
        with path.open("rb") as f:
            return f.read(max_bytes)
    except FileNotFoundError:
        raise AdapterNotFound(name, path.name, f"{str(path)!r} does not exist", limit="a readable file") from None
    except OSError as exc:
        raise AdapterNotFound(name, path.name, f"cannot read {str(path)!r}: {exc}", limit="a readable file") from exc


def _parse_config(name: str, raw: bytes) -> dict:
    try:
        config = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterCorrupt(name, CONFIG_FILE, f"is not valid JSON ({exc})", limit="a JSON object") from exc
    if not isinstance(config, dict):
        raise AdapterCorrupt(name, CONFIG_FILE, f"must be a JSON object, got {type(config).__name__}",
                             limit="a JSON object")
    return config


def _check_config(name: str, config: dict, limits: AdapterLimits) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise InvalidAdapter(name, "peft_type", f"is {config.get('peft_type')!r}", limit="LORA")
    for flag in _UNSUPPORTED_FLAGS:
        if config.get(flag):
            raise InvalidAdapter(name, flag, "is not supported", limit="false")
    for key in _UNSUPPORTED_SET:
        if config.get(key):
            raise InvalidAdapter(name, key, f"is not supported (got {config[key]!r})", limit="null")
    if config.get("bias", "none") != "none":
        raise InvalidAdapter(name, "bias", f"is {config['bias']!r}", limit="none")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise InvalidAdapter(name, "r", f"must be a positive integer, got {rank!r}", limit=">= 1")
    if rank > limits.max_lora_rank:
        raise AdapterRankTooLarge(name, "r", f"rank {rank} exceeds max_lora_rank {limits.max_lora_rank}",
                                  limit=limits.max_lora_rank)
    if not isinstance(config.get("lora_alpha", 8), (int, float)):
        raise InvalidAdapter(name, "lora_alpha", f"must be a number, got {config['lora_alpha']!r}", limit="a number")
    _check_targets(name, config.get("target_modules"))
    _check_alpha_pattern(name, config.get("alpha_pattern") or {})
    _check_base_model(name, str(config.get("base_model_name_or_path") or ""), limits)


def _check_targets(name: str, targets: object) -> None:
    if not isinstance(targets, (list, tuple)):
        return  # a regex (or all-linear already resolved by PEFT): the tensor names are checked instead
    if not all(isinstance(t, str) for t in targets):
        raise InvalidAdapter(name, "target_modules", f"must be module names, got {json_excerpt(targets)}",
                             limit="an array of strings")
    unknown = sorted(set(targets) - set(LORA_MODULES))
    if unknown:
        raise AdapterTargetUnsupported(name, "target_modules", f"{unknown} are not adaptable modules of this "
                                       f"model", limit=sorted(LORA_MODULES))


def _check_alpha_pattern(name: str, patterns: object) -> None:
    if not isinstance(patterns, dict):
        raise InvalidAdapter(name, "alpha_pattern", f"must be an object, got {json_excerpt(patterns)}",
                             limit="{pattern: number}")
    for key, value in patterns.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidAdapter(name, "alpha_pattern", f"{key!r} maps to {json_excerpt(value)}", limit="a number")
        try:
            re.compile(key)
        except re.error as exc:
            raise InvalidAdapter(name, "alpha_pattern", f"{key!r} is not a regular expression ({exc})",
                                 limit="a regular expression") from None


def _check_base_model(name: str, base_model: str, limits: AdapterLimits) -> None:
    base_name = base_model.rstrip("/").rsplit("/", 1)[-1]
    if not base_model or base_name in limits.model_names or base_model in limits.model_names:
        return
    message = f"{base_model!r} differs from the served model {limits.model_names[0]!r}"
    if limits.is_base_model_strict:
        raise AdapterBaseModelMismatch(name, "base_model_name_or_path", message, limit=limits.model_names[0])
    log.warning("adapter %r: base_model_name_or_path %s (shapes match; serving it)", name, message)


def _index_tensors(name: str, header: dict, model: ModelConfig):
    """(layer, module) -> (A key, B key), and key -> shape. Rejects keys the engine cannot apply."""
    found: dict[tuple[int, str], dict[str, str]] = {}
    shapes = {}
    for key, entry in header.items():
        match = _KEY.match(key)
        if match is None or match["module"] not in LORA_MODULES or MODULE_PARENT[match["module"]] != match["parent"]:
            raise AdapterTargetUnsupported(name, "target_modules", f"tensor {key!r} targets a module this engine "
                                           "cannot adapt", limit=sorted(LORA_MODULES))
        layer = int(match["layer"])
        if layer >= model.num_layers:
            raise AdapterShapeMismatch(name, key, f"layer {layer} does not exist (the model has "
                                       f"{model.num_layers} layers)", limit=model.num_layers - 1)
        if entry["dtype"] not in ALLOWED_DTYPES:
            raise InvalidAdapter(name, "dtype", f"tensor {key!r} is {entry['dtype']}", limit=sorted(ALLOWED_DTYPES))
        found.setdefault((layer, match["module"]), {})[match["ab"]] = key
        shapes[key] = tuple(entry["shape"])
    if not found:
        raise InvalidAdapter(name, WEIGHTS_FILE, "holds no LoRA tensors", limit="lora_A/lora_B weights")
    for (layer, module), pair in found.items():
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise AdapterShapeMismatch(name, WEIGHTS_FILE, f"layer {layer} {module} has no {missing}",
                                       limit="lora_A and lora_B")
    return {k: (v["A"], v["B"]) for k, v in sorted(found.items())}, shapes


def _module_ranks(name, tensor_names, shapes, model: ModelConfig, limits: AdapterLimits) -> dict[str, int]:
    ranks: dict[str, int] = {}
    for (layer, module), (a_key, b_key) in tensor_names.items():
        in_dim, out_dim = model.module_dims(module)
        (rank, a_in), (b_out, b_rank) = _as_matrix(name, a_key, shapes), _as_matrix(name, b_key, shapes)
        if a_in != in_dim or b_out != out_dim or b_rank != rank:
            raise AdapterShapeMismatch(name, a_key if a_in != in_dim else b_key,
                                       f"shapes A{list(shapes[a_key])} B{list(shapes[b_key])} do not match the base "
                                       f"{module} ({in_dim} -> {out_dim})",
                                       limit=f"A [r, {in_dim}], B [{out_dim}, r]")
        if rank > limits.max_lora_rank:
            raise AdapterRankTooLarge(name, "rank_pattern", f"{module} in layer {layer} has rank {rank}, above "
                                      f"max_lora_rank {limits.max_lora_rank}", limit=limits.max_lora_rank)
        if rank > limits.max_pool_rows:
            raise AdapterTooLarge(name, "max_lora_pool_bytes", f"{module} rank {rank} exceeds the pool's "
                                  f"{limits.max_pool_rows} rows per module", limit=limits.max_pool_rows)
        ranks[module] = max(ranks.get(module, 0), rank)
    return ranks


def _as_matrix(name: str, key: str, shapes: dict) -> tuple[int, int]:
    shape = shapes[key]
    if len(shape) != 2 or 0 in shape:
        raise AdapterShapeMismatch(name, key, f"has shape {list(shape)}", limit="a non-empty 2-D matrix")
    return shape


def _module_scales(name: str, config: dict, tensor_names, shapes) -> dict[str, float]:
    """PEFT's scaling per module: alpha / r, or alpha / sqrt(r) with rsLoRA; patterns resolved per layer."""
    scales: dict[str, float] = {}
    for (layer, module), (a_key, _) in tensor_names.items():
        rank = shapes[a_key][0]
        alpha = float(_pattern_value(config.get("alpha_pattern") or {}, layer, module, config.get("lora_alpha", 8)))
        scale = alpha / rank**0.5 if config.get("use_rslora") else alpha / rank
        if module in scales and abs(scales[module] - scale) > 1e-12 * max(1.0, abs(scale)):
            raise InvalidAdapter(name, "alpha_pattern", f"{module} scale differs across layers "
                                 f"({scales[module]} vs {scale})", limit="one scale per module")
        scales[module] = scale
    return scales


def _pattern_value(patterns: dict, layer: int, module: str, default):
    """PEFT's rule: a pattern key matches the module's full name when the name ends with it as a regex."""
    full = f"model.layers.{layer}.{MODULE_PARENT[module]}.{module}"
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", full):
            return value
    return default


def _revision(name: str, config_bytes: bytes, weights_file: Path, num_weight_bytes: int) -> str:
    """Hashes the weights as the header sized them; a file that grew or shrank since is refused."""
    digest = hashlib.sha256(config_bytes)
    left = num_weight_bytes
    with weights_file.open("rb") as f:
        while left > 0 and (block := f.read(min(left, 1 << 20))):
            digest.update(block)
            left -= len(block)
        if left or f.read(1):
            raise AdapterCorrupt(name, WEIGHTS_FILE, "changed size while being read", limit="a stable file")
    return digest.hexdigest()[:12]


def _revision_of_bytes(config_bytes: bytes, data: bytes) -> str:
    return hashlib.sha256(config_bytes + data).hexdigest()[:12]
