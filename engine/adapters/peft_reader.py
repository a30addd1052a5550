"""Read and validate PEFT LoRA adapters (adapter_config.json + adapter_model.safetensors).

`read_adapter_spec` reads the config and the safetensors header only (nothing resident); `read_adapter_weights`
reads the tensors into host memory. Every failure is a typed `InvalidAdapter` naming the adapter, the field
and the limit; nothing here touches engine state.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from kubelora.engine.adapters.files import open_regular
from kubelora.engine.adapters.peft_config import CONFIG_FILE, MAX_CONFIG_BYTES, PeftConfig, parse_config
from kubelora.engine.adapters.safetensors_header import WEIGHTS_FILE, read_header
from kubelora.engine.adapters.spec import AdapterLimits, AdapterSpec, HostAdapter
from kubelora.engine.errors import (
    AdapterChanged,
    AdapterCorrupt,
    AdapterNotFound,
    AdapterRankTooLarge,
    AdapterShapeMismatch,
    AdapterTargetUnsupported,
    AdapterTooLarge,
    InvalidAdapter,
)
from kubelora.engine.model.config import MODULE_PARENT, ModelConfig, engine_modules

ALLOWED_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# The decoder's layers as PEFT names them: under `model.`, or a multimodal Gemma 3's language model (transformers 5
# and 4 layouts, engine/model/weights.py)
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<prefix>model\.(?:language_model\.)?|language_model\.model\.)layers\.(?P<layer>\d+)\."
    r"(?P<parent>self_attn|mlp)\.(?P<module>\w+)\.lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight$"
)


def read_adapter_spec(name: str, path: str | Path, model: ModelConfig, limits: AdapterLimits) -> AdapterSpec:
    root = Path(path)
    if not root.is_dir():
        raise AdapterNotFound(name, "path", f"{str(root)!r} is not a directory", limit="an adapter directory")
    config_bytes = _read_config(name, root / CONFIG_FILE)
    config = parse_config(name, config_bytes, limits)
    weights_file = root / WEIGHTS_FILE
    header, num_weight_bytes = read_header(name, weights_file)
    tensor_names, shapes, prefix = _index_tensors(name, header, model)
    ranks = _module_ranks(name, config, tensor_names, shapes, model, limits, prefix)
    return AdapterSpec(
        name=name,
        path=str(root),
        revision=_revision(name, config_bytes, weights_file, num_weight_bytes),
        num_weight_bytes=num_weight_bytes,
        ranks=ranks,
        scales=_module_scales(name, config, tensor_names, prefix),
        tensor_names=tensor_names,
        base_model=config.base_model,
        use_rslora=config.use_rslora,
    )


def read_adapter_weights(spec: AdapterSpec, model: ModelConfig, dtype: torch.dtype, pin: bool) -> HostAdapter:
    """Read the tensors (one file read), check they still hash to spec.revision, lay them out per engine module. A
    fused module's (Phi-3's qkv_proj, gate_up_proj) lora_A goes to each module it holds, its lora_B split by their
    output rows: the same deltas, with A stored (and its shrink computed) once per module."""
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
    for (layer, peft_module), (a_key, b_key) in spec.tensor_names.items():
        lora_a, lora_b = tensors[a_key], tensors[b_key]
        first = 0
        for module in engine_modules(peft_module):
            out_dim = model.module_dims(module)[1]
            a[module][layer, : lora_a.shape[0]] = lora_a  # cast to the pool's dtype by the copy
            b[module][layer, : lora_b.shape[1]] = lora_b[first : first + out_dim].T
            first += out_dim
    _check_finite(spec, tensors, [*a.values(), *b.values()], dtype)
    if pin:
        a = {m: t.pin_memory() for m, t in a.items()}
        b = {m: t.pin_memory() for m, t in b.items()}
    return HostAdapter(a=a, b=b)


def _check_finite(spec: AdapterSpec, tensors: dict[str, torch.Tensor], buffers: list[torch.Tensor],
                  dtype: torch.dtype) -> None:
    """Refuse NaN or infinite weights as the pool holds them, cast to its dtype: a cast keeps NaN and infinity,
    and makes a float32 value past the float16 range infinite. One adapter's non-finite values would poison every
    output it touches. One check per module's buffer (a torch op: the GIL is free meanwhile); the tensor at fault
    is looked for only when one fails."""
    if all(bool(torch.isfinite(buffer).all()) for buffer in buffers):
        return
    for a_key, b_key in spec.tensor_names.values():
        for key in (a_key, b_key):
            if not torch.isfinite(tensors[key].to(dtype)).all():
                raise AdapterCorrupt(spec.name, key, f"holds NaN or infinite values (as "
                                     f"{str(dtype).removeprefix('torch.')})", limit="finite weights")


def _read_config(name: str, path: Path) -> bytes:
    data = _read_file(name, path, MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise InvalidAdapter(name, CONFIG_FILE, f"is larger than {MAX_CONFIG_BYTES} bytes",
                             limit=f"<= {MAX_CONFIG_BYTES} bytes")
    return data


def _read_file(name: str, path: Path, max_bytes: int) -> bytes:
    """At most `max_bytes` of the file."""
    with open_regular(name, path) as f:
        try:
            return f.read(max_bytes)
        except OSError as exc:
            raise AdapterNotFound(name, path.name, f"cannot read {str(path)!r}: {exc}",
                                  limit="a readable file") from exc


def _index_tensors(name: str, header: dict, model: ModelConfig):
    """(layer, PEFT module) -> (A key, B key), key -> shape, and the prefix of the modules' names (module_name).
    Rejects keys the engine cannot apply: a module the served model does not have (q_proj of Phi-3, whose checkpoint
    fuses it into qkv_proj) included."""
    found: dict[tuple[int, str], dict[str, str]] = {}
    shapes = {}
    prefixes = set()
    modules = model.family.peft_modules
    for key, entry in header.items():
        match = _KEY.match(key)
        if match is None or match["module"] not in modules or MODULE_PARENT[match["module"]] != match["parent"]:
            raise AdapterTargetUnsupported(name, "target_modules", f"tensor {key!r} targets a module this engine "
                                           f"cannot adapt in a {model.model_type} model", limit=sorted(modules))
        layer = int(match["layer"])
        if layer >= model.num_layers:
            raise AdapterShapeMismatch(name, key, f"layer {layer} does not exist (the model has "
                                       f"{model.num_layers} layers)", limit=model.num_layers - 1)
        if entry["dtype"] not in ALLOWED_DTYPES:
            raise InvalidAdapter(name, "dtype", f"tensor {key!r} is {entry['dtype']}", limit=sorted(ALLOWED_DTYPES))
        found.setdefault((layer, match["module"]), {})[match["ab"]] = key
        shapes[key] = tuple(entry["shape"])
        prefixes.add(match["prefix"])
    if not found:
        raise InvalidAdapter(name, WEIGHTS_FILE, "holds no LoRA tensors", limit="lora_A/lora_B weights")
    if len(prefixes) > 1:
        raise AdapterTargetUnsupported(name, "target_modules", f"tensors name the decoder layers under "
                                       f"{sorted(prefixes)}", limit="one model's layers")
    for (layer, module), pair in found.items():
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise AdapterShapeMismatch(name, WEIGHTS_FILE, f"layer {layer} {module} has no {missing}",
                                       limit="lora_A and lora_B")
    return {k: (v["A"], v["B"]) for k, v in sorted(found.items())}, shapes, prefixes.pop()


def _module_ranks(name: str, config: PeftConfig, tensor_names, shapes, model: ModelConfig,
                  limits: AdapterLimits, prefix: str) -> dict[str, int]:
    """Engine module -> rank (a fused module's rank for each module it holds)."""
    ranks: dict[str, int] = {}
    for (layer, module), (a_key, b_key) in tensor_names.items():
        rank = _tensor_rank(name, a_key, b_key, shapes, model.module_dims(module))
        expected = config.module_rank(layer, module, prefix)
        if rank != expected:  # PEFT refuses these tensors (a size mismatch when it loads them)
            raise AdapterShapeMismatch(name, a_key, f"{module} in layer {layer} has rank {rank} tensors, but the "
                                       f"config gives it rank {expected} (r or rank_pattern)", limit=expected)
        if rank > limits.max_lora_rank:
            raise AdapterRankTooLarge(name, "rank_pattern", f"{module} in layer {layer} has rank {rank}, above "
                                      f"max_lora_rank {limits.max_lora_rank}", limit=limits.max_lora_rank)
        if rank > limits.max_pool_rows:
            raise AdapterTooLarge(name, "max_lora_pool_bytes", f"{module} rank {rank} exceeds the pool's "
                                  f"{limits.max_pool_rows} rows per module", limit=limits.max_pool_rows)
        for held in engine_modules(module):
            ranks[held] = max(ranks.get(held, 0), rank)
    return ranks


def _tensor_rank(name: str, a_key: str, b_key: str, shapes: dict, dims: tuple[int, int]) -> int:
    """The rank of one module's A [r, in_dim] and B [out_dim, r], checked against the base module's dims."""
    in_dim, out_dim = dims
    (rank, a_in), (b_out, b_rank) = _as_matrix(name, a_key, shapes), _as_matrix(name, b_key, shapes)
    if a_in != in_dim or b_out != out_dim or b_rank != rank:
        raise AdapterShapeMismatch(name, a_key if a_in != in_dim else b_key,
                                   f"shapes A{list(shapes[a_key])} B{list(shapes[b_key])} do not match the base "
                                   f"module ({in_dim} -> {out_dim})", limit=f"A [r, {in_dim}], B [{out_dim}, r]")
    return rank


def _as_matrix(name: str, key: str, shapes: dict) -> tuple[int, int]:
    shape = shapes[key]
    if len(shape) != 2 or 0 in shape:
        raise AdapterShapeMismatch(name, key, f"has shape {list(shape)}", limit="a non-empty 2-D matrix")
    return shape


def _module_scales(name: str, config: PeftConfig, tensor_names, prefix: str) -> dict[str, float]:
    """PEFT's scaling per engine module (`PeftConfig.module_scale`), which must be the same in every layer."""
    scales: dict[str, float] = {}
    for layer, peft_module in tensor_names:
        scale = config.module_scale(layer, peft_module, prefix)
        for module in engine_modules(peft_module):
            if module in scales and abs(scales[module] - scale) > 1e-12 * max(1.0, abs(scale)):
                raise InvalidAdapter(name, "alpha_pattern", f"{peft_module} scale differs across layers "
                                     f"({scales[module]} vs {scale})", limit="one scale per module")
            scales[module] = scale
    return scales


def _revision(name: str, config_bytes: bytes, weights_file: Path, num_weight_bytes: int) -> str:
    """Hashes the weights as the header sized them; a file that grew or shrank since is refused."""
    digest = hashlib.sha256(config_bytes)
    left = num_weight_bytes
    with open_regular(name, weights_file) as f:
        while left > 0 and (block := f.read(min(left, 1 << 20))):
            digest.update(block)
            left -= len(block)
        if left or f.read(1):
            raise AdapterCorrupt(name, WEIGHTS_FILE, "changed size while being read", limit="a stable file")
    return digest.hexdigest()[:12]


def _revision_of_bytes(config_bytes: bytes, data: bytes) -> str:
    return hashlib.sha256(config_bytes + data).hexdigest()[:12]
