"""Read and validate PEFT LoRA adapters (adapter_config.json + adapter_model.safetensors).

`read_adapter_spec` reads the config and the safetensors header only (nothing resident); `read_adapter_weights`
reads the tensors into host memory. Every failure is a typed `InvalidAdapter` naming the adapter, the field
and the limit; nothing here touches engine state.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

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
    InvalidAdapter,
)
from kubelora.engine.adapters.pool import VOCAB_MODULES, module_dims, part_width
from kubelora.engine.model.config import MODULE_PARENT, ModelConfig, engine_modules
from kubelora.engine.model.weights import CheckpointReader

ALLOWED_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# The decoder's layers as PEFT names them: under `model.`, or a multimodal Gemma 3's language model (transformers 5
# and 4 layouts, engine/model/weights.py)
_DECODER = r"^(?:base_model\.model\.)?(?P<prefix>model\.(?:language_model\.)?|language_model\.model\.)"
_KEY = re.compile(
    _DECODER + r"layers\.(?P<layer>\d+)\.(?P<parent>self_attn|mlp)\.(?P<module>\w+)\."
    r"(?:lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight|(?P<magnitude>lora_magnitude_vector)(?:\.[\w-]+)?(?:\.weight)?)$"
)
# LoRA on the vocabulary-wide modules: embed_tokens' lora_embedding_A [r, vocab] / lora_embedding_B [hidden, r],
# lm_head's lora_A [r, hidden] / lora_B [vocab, r]
_EMBED_KEY = re.compile(_DECODER + r"embed_tokens\.lora_embedding_(?P<ab>[AB])(?:\.[\w-]+)?$")
_LM_HEAD_KEY = re.compile(r"^(?:base_model\.model\.)?(?:language_model\.)?lm_head\.lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight$")
# PEFT's full copies of the embedding and lm_head (save_embedding_layers): served when equal to the base's
_COPY_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>(?:model\.(?:language_model\.)?|language_model\.model\.)"
                       r"embed_tokens|(?:language_model\.)?lm_head)(?:\.base_layer)?\.weight$")
_COPY_ROWS = 4096  # rows compared at a time: the copies stream through, never held whole


def read_adapter_spec(name: str, path: str | Path, model: ModelConfig, limits: AdapterLimits) -> AdapterSpec:
    root = Path(path)
    if not root.is_dir():
        raise AdapterNotFound(name, "path", f"{str(root)!r} is not a directory", limit="an adapter directory")
    config_bytes = _read_config(name, root / CONFIG_FILE)
    config = parse_config(name, config_bytes, limits)
    weights_file = root / WEIGHTS_FILE
    header, num_weight_bytes = read_header(name, weights_file)
    index = _index_tensors(name, header, model, config.use_dora)
    tensor_names, shapes, prefix = index.tensor_names, index.shapes, index.prefix
    ranks = _module_ranks(name, config, tensor_names, shapes, model, limits, prefix)
    if config.use_dora:
        _check_magnitudes(name, index, model)
    if index.copies:
        _check_copies(name, weights_file, index.copies, model, limits)
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
        use_dora=config.use_dora,
        magnitude_names=index.magnitude_names,
    )


def read_adapter_weights(spec: AdapterSpec, model: ModelConfig, dtype: torch.dtype, pin: bool) -> HostAdapter:
    """Read the tensors (one pass over the file), check they still hash to spec.revision, lay them out per engine
    module. A
    fused module's (Phi-3's qkv_proj, gate_up_proj) lora_A goes to each module it holds, its lora_B split by their
    output rows: the same deltas, with A stored (and its shrink computed) once per module."""
    root = Path(spec.path)
    config_bytes = _read_config(spec.name, root / CONFIG_FILE)
    keys = {*(k for pair in spec.tensor_names.values() for k in pair), *spec.magnitude_names.values()}
    tensors = _read_tensors(spec, root / WEIGHTS_FILE, config_bytes, keys)
    a, b, magnitude = {}, {}, {}
    layers = model.num_layers
    for module, rank in spec.ranks.items():
        a[module] = torch.zeros(layers, rank, part_width(model, module, "a"), dtype=dtype)
        b[module] = torch.zeros(layers, rank, part_width(model, module, "b"), dtype=dtype)
        if spec.use_dora and module not in VOCAB_MODULES:
            magnitude[module] = torch.zeros(layers, module_dims(model, module)[1], dtype=dtype)
    for (layer, peft_module), (a_key, b_key) in spec.tensor_names.items():
        lora_a, lora_b = tensors[a_key], tensors[b_key]
        if layer < 0:  # a vocabulary module: each row cut into one piece per layer, as the pool holds it
            _put_pieces(a[peft_module], lora_a)
            _put_pieces(b[peft_module], lora_b.T)
            continue
        first = 0
        vector = tensors[spec.magnitude_names[(layer, peft_module)]] if spec.use_dora else None
        for module in engine_modules(peft_module):
            out_dim = model.module_dims(module)[1]
            a[module][layer, : lora_a.shape[0]] = lora_a  # cast to the pool's dtype by the copy
            b[module][layer, : lora_b.shape[1]] = lora_b[first : first + out_dim].T
            if vector is not None:
                magnitude[module][layer] = vector[first : first + out_dim]
            first += out_dim
    _check_finite(spec, tensors, [*a.values(), *b.values(), *magnitude.values()], dtype)
    if pin:
        a = {m: t.pin_memory() for m, t in a.items()}
        b = {m: t.pin_memory() for m, t in b.items()}
        magnitude = {m: t.pin_memory() for m, t in magnitude.items()}
    return HostAdapter(a=a, b=b, magnitude=magnitude)


def _put_pieces(rows: torch.Tensor, matrix: torch.Tensor) -> None:
    """matrix [rank, dim] into rows [num_layers, >= rank, piece]: row i's piece l is matrix[i, l*piece:(l+1)*piece]."""
    layers, _, piece = rows.shape
    padded = torch.zeros(matrix.shape[0], layers * piece, dtype=rows.dtype)
    padded[:, : matrix.shape[1]] = matrix
    rows[:, : matrix.shape[0]] = padded.view(matrix.shape[0], layers, piece).transpose(0, 1)


def _check_finite(spec: AdapterSpec, tensors: dict[str, torch.Tensor], buffers: list[torch.Tensor],
                  dtype: torch.dtype) -> None:
    """Refuse NaN or infinite weights as the pool holds them, cast to its dtype: a cast keeps NaN and infinity,
    and makes a float32 value past the float16 range infinite. One adapter's non-finite values would poison every
    output it touches. One check per module's buffer (a torch op: the GIL is free meanwhile); the tensor at fault
    is looked for only when one fails."""
    if all(bool(torch.isfinite(buffer).all()) for buffer in buffers):
        return
    for key in [*(k for pair in spec.tensor_names.values() for k in pair), *spec.magnitude_names.values()]:
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


@dataclass(frozen=True)
class _Index:
    tensor_names: dict[tuple[int, str], tuple[str, str]]  # (layer, PEFT module) -> (A key, B key); layer -1: vocab
    shapes: dict[str, tuple[int, ...]]
    prefix: str  # where the decoder's modules are named (module_name)
    magnitude_names: dict[tuple[int, str], str]  # DoRA: (layer, PEFT module) -> lora_magnitude_vector key
    copies: dict[str, str]  # full embedding / lm_head copy key -> "embed_tokens" | "lm_head"


def _index_tensors(name: str, header: dict, model: ModelConfig, use_dora: bool) -> _Index:
    """Every key of the file sorted into what the engine serves; any other key refused, named: a module the served
    model does not have (q_proj of Phi-3, whose checkpoint fuses it into qkv_proj) included."""
    found: dict[tuple[int, str], dict[str, str]] = {}
    shapes, magnitudes, copies = {}, {}, {}
    prefixes = set()
    modules = model.family.peft_modules
    for key, entry in header.items():
        if entry["dtype"] not in ALLOWED_DTYPES:
            raise InvalidAdapter(name, "dtype", f"tensor {key!r} is {entry['dtype']}", limit=sorted(ALLOWED_DTYPES))
        shapes[key] = tuple(entry["shape"])
        vocab = _EMBED_KEY.match(key) or _LM_HEAD_KEY.match(key)
        if vocab is not None:
            module = "embed_tokens" if vocab.re is _EMBED_KEY else "lm_head"
            found.setdefault((-1, module), {})[vocab["ab"]] = key
            continue
        copy = _COPY_KEY.match(key)
        if copy is not None:
            copies[key] = "lm_head" if copy["module"].endswith("lm_head") else "embed_tokens"
            continue
        match = _KEY.match(key)
        if match is None or match["module"] not in modules or MODULE_PARENT[match["module"]] != match["parent"]:
            what = "DoRA on a vocabulary module" if "lora_magnitude_vector" in key else "a module"
            raise AdapterTargetUnsupported(name, "target_modules", f"tensor {key!r} targets {what} this engine cannot adapt in "
                                           f"a {model.model_type} model", limit=sorted(modules))
        layer = int(match["layer"])
        if layer >= model.num_layers:
            raise AdapterShapeMismatch(name, key, f"layer {layer} does not exist (the model has "
                                       f"{model.num_layers} layers)", limit=model.num_layers - 1)
        prefixes.add(match["prefix"])
        if match["magnitude"]:
            if not use_dora:
                raise InvalidAdapter(name, key, "is a DoRA magnitude but use_dora is false", limit="use_dora: true")
            magnitudes[(layer, match["module"])] = key
            continue
        found.setdefault((layer, match["module"]), {})[match["ab"]] = key
    if not found:
        raise InvalidAdapter(name, WEIGHTS_FILE, "holds no LoRA tensors", limit="lora_A/lora_B weights")
    if len(prefixes) > 1:
        raise AdapterTargetUnsupported(name, "target_modules", f"tensors name the decoder layers under "
                                       f"{sorted(prefixes)}", limit="one model's layers")
    for (layer, module), pair in found.items():
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise AdapterShapeMismatch(name, WEIGHTS_FILE, f"{_where(layer, module)} has no {missing}",
                                       limit="lora_A and lora_B")
    return _Index({k: (v["A"], v["B"]) for k, v in sorted(found.items())}, shapes,
                  prefixes.pop() if prefixes else "model.", magnitudes, copies)


def _where(layer: int, module: str) -> str:
    return module if layer < 0 else f"layer {layer} {module}"


def _check_magnitudes(name: str, index: _Index, model: ModelConfig) -> None:
    """With DoRA, every layered module has its magnitude, one value per output channel."""
    for layer, module in index.tensor_names:
        if layer < 0:
            continue
        key = index.magnitude_names.get((layer, module))
        out_dim = model.module_dims(module)[1]
        if key is None:
            raise AdapterShapeMismatch(name, WEIGHTS_FILE, f"{_where(layer, module)} has no lora_magnitude_vector "
                                       "(use_dora is true)", limit="one per DoRA module")
        if index.shapes[key] != (out_dim,):
            raise AdapterShapeMismatch(name, key, f"has shape {list(index.shapes[key])}", limit=[out_dim])


def _check_copies(name: str, weights_file: Path, copies: dict[str, str], model: ModelConfig,
                  limits: AdapterLimits) -> None:
    """PEFT's full copies of the embedding / lm_head (save_embedding_layers) must equal the base's: compared a few
    thousand rows at a time, read from both files, never held whole. A copy that differs (a resized vocabulary,
    trained embeddings) is refused naming its key."""
    if limits.model_dir is None:
        raise AdapterTargetUnsupported(name, next(iter(copies)), "is a full embedding copy and this engine has no "
                                       "base checkpoint to compare it with", limit="no full copies")
    reader = CheckpointReader(Path(limits.model_dir))
    base_names = reader.vocab_names(model)
    with safe_open(str(weights_file), framework="pt") as f:
        for key, module in copies.items():
            base = base_names[module]
            shape, base_shape = tuple(f.get_slice(key).get_shape()), reader.shape(base)
            if shape != base_shape:
                raise AdapterShapeMismatch(name, key, f"is a full {module} of shape {list(shape)}, the base's is "
                                           f"{list(base_shape)} (a resized vocabulary is not served)",
                                           limit=list(base_shape))
            for first in range(0, shape[0], _COPY_ROWS):
                rows = f.get_slice(key)[first : first + _COPY_ROWS]
                if not torch.equal(rows.float(), reader.rows(base, first, first + _COPY_ROWS).float()):
                    raise InvalidAdapter(name, key, f"is a full {module} that differs from the base's (trained "
                                         "embeddings are not served; save the adapter with "
                                         "save_embedding_layers=False if they are the base's)",
                                         limit="the base's weights")


def _module_ranks(name: str, config: PeftConfig, tensor_names, shapes, model: ModelConfig,
                  limits: AdapterLimits, prefix: str) -> dict[str, int]:
    """Engine module -> rank (a fused module's rank for each module it holds)."""
    ranks: dict[str, int] = {}
    for (layer, module), (a_key, b_key) in tensor_names.items():
        rank = _tensor_rank(name, a_key, b_key, shapes, module_dims(model, module))
        expected = config.module_rank(layer, module, prefix)
        if rank != expected:  # PEFT refuses these tensors (a size mismatch when it loads them)
            raise AdapterShapeMismatch(name, a_key, f"{module} in layer {layer} has rank {rank} tensors, but the "
                                       f"config gives it rank {expected} (r or rank_pattern)", limit=expected)
        if rank > limits.max_lora_rank:
            raise AdapterRankTooLarge(name, "rank_pattern", f"{module} in layer {layer} has rank {rank}, above "
                                      f"max_lora_rank {limits.max_lora_rank}", limit=limits.max_lora_rank)
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


def _read_tensors(spec: AdapterSpec, path: Path, config_bytes: bytes, keys: set[str]) -> dict[str, torch.Tensor]:
    """The tensors named in `keys`, read in one pass over the file that hashes all of it (never more than the
    registered size): the other tensors (PEFT's full embedding copies) stream through the hash and are not kept.
    A file whose bytes no longer hash to spec.revision is `AdapterChanged`."""
    digest, left = hashlib.sha256(config_bytes), spec.num_weight_bytes
    changed = AdapterChanged(spec.name, f"files under {spec.path} changed since revision {spec.revision} was "
                                        "registered; load it again with load_inplace")

    def read(count: int, keep: bool) -> bytes:
        nonlocal left
        parts = []
        while count > 0:
            block = f.read(min(count, left, 1 << 20))
            if not block:
                raise changed
            digest.update(block)
            left, count = left - len(block), count - len(block)
            if keep:
                parts.append(block)
        return b"".join(parts)

    with open_regular(spec.name, path) as f:
        try:
            header_len = int.from_bytes(read(8, True), "little")
            header = json.loads(read(header_len, True))
            entries = sorted((header[key]["data_offsets"], key, header[key]) for key in keys)
        except (ValueError, KeyError, TypeError):
            raise changed from None
        raw, position = {}, 0
        for (begin, end), key, _ in entries:
            read(begin - position, False)
            raw[key] = read(end - begin, True)
            position = end
        read(left, False)
        if f.read(1) or digest.hexdigest()[:12] != spec.revision:
            raise changed
    return {key: torch.frombuffer(bytearray(raw[key]), dtype=ALLOWED_DTYPES[entry["dtype"]]).view(entry["shape"])
            for _, key, entry in entries}
