"""FP8 base weights as their checkpoints store them, in the layer table where a float weight would be.

A quantized projection kind (fused qkv, o, fused gate_up, down) is one `Fp8Linear`: the FP8 values of its modules
stacked as a float weight's rows are, and their scales on one grid (kernels/fp8.py states the math). The decoder's
projection calls it in place of its float matmul; LoRA deltas are added to its output in the activation dtype as on
a float base. Weights stay FP8 in memory on every device: the KV cache and the adapter pool are sized from what they
leave free, and the CPU path (tests, demo) dequantizes per call rather than keeping a float copy (2x the bytes in
bfloat16, 4x in float32) — an elementwise pass beside each matmul, on a path that is not the fast one. On CUDA the
matmul runs on the FP8 tensor cores (kernels/fp8.py).

Scheme, format and what is refused: engine/model/config.py (`Fp8Quantization`); modules the checkpoint's ignore
list names stay float and are read as on a float base.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from kubelora.engine.model.config import Fp8Quantization, ModelConfig
from kubelora.kernels.fp8 import FP8, fp8_linear


@dataclass(frozen=True)
class Fp8Linear:
    weight: torch.Tensor  # [out_dim, in_dim] float8_e4m3fn
    scale: torch.Tensor  # [ceil(out_dim / block[0]), ceil(in_dim / block[1])] float32
    block: tuple[int, int]  # (rows, cols) of the weight that one scale covers
    activations: str  # how the GPU path quantizes the input (config.ACTIVATION_SCHEMES)
    input_scale: torch.Tensor | None = None  # float32 [1]: the static scheme's input scale

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        """Bytes as stored: the FP8 values and their scales."""
        tensors = [self.weight, self.scale] + ([self.input_scale] if self.input_scale is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def to(self, device: torch.device) -> Fp8Linear:
        scale = None if self.input_scale is None else self.input_scale.to(device)
        return replace(self, weight=self.weight.to(device), scale=self.scale.to(device), input_scale=scale)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x: [num_tokens, in_dim] -> x W^T + b [num_tokens, out_dim] in x's dtype."""
        return fp8_linear(x, self.weight, self.scale, self.block, bias, self.activations, self.input_scale)


def is_stored_fp8(quantization: Fp8Quantization | None, modules: list[str]) -> bool:
    """Whether the checkpoint modules of one projection kind (full names, e.g. "model.layers.0.mlp.up_proj") are
    FP8: all of them or none (the ignore list must not split a fused kind)."""
    if quantization is None:
        return False
    stored = [quantization.is_quantized(m) for m in modules]
    if any(stored) and not all(stored):
        kept = [m for m, s in zip(modules, stored) if not s]
        raise ValueError(f"quantization_config's ignore list keeps {kept} unquantized but not the rest of "
                         f"{modules}, which the engine runs as one matmul; ignore all of them or none")
    return all(stored)


def read_fp8_linear(reader, modules: list[str], quantization: Fp8Quantization) -> Fp8Linear:
    """One projection kind's modules (full checkpoint names, in output order) read from a CheckpointReader
    (engine/model/weights.py) into one Fp8Linear."""
    parts = [_read_module(reader, m, quantization) for m in modules]
    weight = torch.cat([q for q, _, _ in parts])
    scale, block = _stack_scales([(q.shape[0], s, b) for q, s, b in parts])
    input_scale = None
    if quantization.activations == "static-tensor":  # one input, one scale: the largest keeps every input in range
        input_scale = torch.stack([reader.get(f"{m}.input_scale", torch.float32).reshape(()) for m in modules])
        input_scale = input_scale.amax().reshape(1)
    return Fp8Linear(weight, scale, block, quantization.activations, input_scale)


def _read_module(reader, module: str, quantization: Fp8Quantization):
    """(FP8 values [out, in], float32 scale grid, its block) of one checkpoint module."""
    scale_name = f"{module}.{quantization.scale_name}"
    if not reader.has(scale_name):
        raise ValueError(f"checkpoint tensor {scale_name!r} is missing: quantization_config says {module} is "
                         f"stored FP8 ({quantization.name}) and its ignore list does not name it")
    q = reader.get(f"{module}.weight", FP8)
    scale = reader.get(scale_name, torch.float32)
    out_dim, in_dim = q.shape
    if quantization.weight_strategy == "tensor":
        return q, scale.reshape(1, 1), (out_dim, in_dim)
    if quantization.weight_strategy == "channel":
        return q, scale.reshape(out_dim, 1), (1, in_dim)
    block = quantization.weight_block
    expected = (math.ceil(out_dim / block[0]), math.ceil(in_dim / block[1]))
    if tuple(scale.shape) != expected:
        raise ValueError(f"checkpoint tensor {scale_name!r} has shape {tuple(scale.shape)}; {block} blocks of a "
                         f"{(out_dim, in_dim)} weight need {expected}")
    return q, scale, block


def _stack_scales(parts: list[tuple[int, torch.Tensor, tuple[int, int]]]) -> tuple[torch.Tensor, tuple[int, int]]:
    """The scale grids of stacked modules ((rows, grid, block) each) as one grid: stacked as they are when every
    module but the last ends on a block boundary, else expanded to one scale row per weight row. All share the
    block width (one scheme, one in_dim)."""
    block = parts[0][2]
    if all(b == block for _, _, b in parts) and all(rows % block[0] == 0 for rows, _, _ in parts[:-1]):
        return torch.cat([grid for _, grid, _ in parts]), block
    rows = [grid.repeat_interleave(b[0], 0)[:n] for n, grid, b in parts]
    return torch.cat(rows), (1, block[1])


@dataclass(frozen=True)
class BaseWeightsInfo:
    """What the model card and metrics say of the base weights."""

    format: str  # the FP8 scheme's name (Fp8Quantization.name), else the float dtype's ("bfloat16")
    bytes: int  # as stored: FP8 values and scales for quantized projections, a tied lm_head once


def base_weights_info(config: ModelConfig, weights) -> BaseWeightsInfo:
    """weights: engine/model/weights.py's ModelWeights, as loaded."""
    tensors = [weights.embed, weights.final_norm] + ([] if weights.lm_head is weights.embed else [weights.lm_head])
    for layer in weights.layers:
        tensors += [*layer.norm.values(), *layer.weight.values(), *(b for b in layer.bias.values() if b is not None)]
    num_bytes = sum(t.nbytes if isinstance(t, Fp8Linear) else t.numel() * t.element_size() for t in tensors)
    quantization = config.quantization
    fmt = quantization.name if quantization is not None else str(weights.embed.dtype).removeprefix("torch.")
    return BaseWeightsInfo(fmt, num_bytes)
