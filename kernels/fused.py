"""The decoder's small ops fused into one Triton launch each: residual add + RMSNorm (w or Gemma's 1 + w), SiLU x mul
and GeGLU (tanh GELU x mul), rotary in place (alone, or with the layer's KV-cache write: `rotary_kv_cache_`, which
also applies the per-head q/k RMSNorm of Qwen3 and Gemma 3 before it rotates).

Each op's plain-torch reference sits beside it with the same signature and computes, op for op, what
engine/model/llama.py (`rms_norm`, `hidden + delta`, `F.silu(gate) * up`) and engine/model/rope.py
(`RotaryEmbedding.cos_sin`, `apply_rotary`) compute. The Triton ops keep every rounding step of the references
(sums and products of two 16-bit values are computed in float32 and rounded once, as torch rounds them); they
differ only where float32 math itself differs: the order of the RMS sum, Triton's exp (ex2.approx on CUDA), and
any last bit between libdevice's rsqrt/cos/sin and torch's (the interpreter: numpy's). In bf16/fp16
that flips a rounding on rare elements: 1 ulp of an intermediate, up to 2 ulp of normed after the weight product
rounds again. Rotary on CUDA is the exception: its cos/sin at large angles differ from torch's in the last
float32 bits often enough to flip the 16-bit rounding of up to a quarter of the elements (each within the
bound). `tests/test_kernels/test_fused.py` holds the tolerances per dtype.

Launches are CUDA-graph safe: grids and block sizes come from shapes only, nothing syncs the host. Call each op
once eagerly per shape before capturing it (the first call compiles).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def is_interpreted() -> bool:
    """True when these kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return type(_add_rms_norm_kernel).__name__ == "InterpretedFunction"


def _check_device(t: torch.Tensor) -> None:
    if t.device.type != "cuda" and not is_interpreted():
        raise RuntimeError("the fused Triton ops off CUDA need TRITON_INTERPRET=1 before kubelora.kernels loads")


# ---- residual add + RMSNorm ----------------------------------------------------------------------------------


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, is_unit_offset: bool = False) -> torch.Tensor:
    """Reference: weight * (x * rsqrt(mean(x^2) + eps)) over the last dimension, as transformers computes it.

    x: [..., dim]; weight: [dim]. The norm runs in float32; Llama's form casts it to x.dtype, then scales by weight
    in the promoted dtype; is_unit_offset (Gemma: weight stored zero-centred) scales by (1 + weight) in float32 and
    casts once after.
    """
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if is_unit_offset:
        return (x32 * (1.0 + weight.float())).to(x.dtype)
    return weight * x32.to(x.dtype)


def add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                       out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
                       is_unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: r = x + residual (r = x without residual); normed = `rms_norm_torch(r, weight, eps, is_unit_offset)`.

    x, residual, residual_out: [num_tokens, hidden]; weight: [hidden]; out: [num_tokens, hidden].
    r is rounded to x.dtype. out / residual_out: optional buffers written in place (residual_out may be `residual`).
    Returns (normed, r).
    """
    if residual is None:
        assert residual_out is None, "without a residual, residual_out is x itself"
        summed = x
    else:
        summed = x + residual if residual_out is None else torch.add(x, residual, out=residual_out)
    normed = rms_norm_torch(summed, weight, eps, is_unit_offset)
    if out is not None:
        normed = out.copy_(normed)
    return normed, summed


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, x_stride, residual_stride,
                         out_stride, residual_out_stride, hidden, eps, HAS_RESIDUAL: tl.constexpr,
                         IS_UNIT_OFFSET: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)  # rounded as `hidden + delta` is
        tl.store(residual_out_ptr + row * residual_out_stride + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_sq = tl.sum(x32 * x32, axis=0) / hidden
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = _scale_normed(x32 * tl.rsqrt(mean_sq + eps), weight, x.dtype, IS_UNIT_OFFSET)
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scale_normed(normed, weight, dtype, IS_UNIT_OFFSET: tl.constexpr):
    """`rms_norm_torch`'s scaling of the float32 norm: Llama's weight times the norm rounded to dtype (rounded again
    by the caller's store), or Gemma's (1 + weight) times the norm in float32, rounded to dtype once."""
    if IS_UNIT_OFFSET:
        return (normed * (1.0 + weight.to(tl.float32))).to(dtype).to(tl.float32)
    return weight.to(tl.float32) * normed.to(dtype).to(tl.float32)


def _norm_warps(block: int) -> int:
    """About 16 bytes of bf16 per thread and load: 8 warps for a 4096-wide row, 1 up to 512."""
    return min(max(block // 512, 1), 16)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
                 is_unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton: r = x + residual (r = x without residual); normed = `rms_norm_torch(r, weight, eps, is_unit_offset)`.

    Same arguments, shapes and roundings as `add_rms_norm_torch`; one program per row. Rows may be strided
    (views), columns must be contiguous. out may alias x, residual_out may alias residual (each row is read
    before it is written, by the one program that owns it).
    """
    _check_device(x)
    num_tokens, hidden = x.shape
    assert x.dtype in FLOAT_DTYPES and weight.shape == (hidden,) and weight.stride(0) == 1
    assert residual is not None or residual_out is None, "without a residual, residual_out is x itself"
    if out is None:
        out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        residual_out = torch.empty_like(x) if residual_out is None else residual_out
    summed = x if residual is None else residual_out
    for t in (x, out, summed) + (() if residual is None else (residual,)):
        assert t.shape == x.shape and t.stride(1) == 1, "rows of [num_tokens, hidden] with contiguous columns"
    if num_tokens == 0:
        return out, summed
    block = triton.next_power_of_2(hidden)
    res = x if residual is None else residual  # unread without HAS_RESIDUAL
    _add_rms_norm_kernel[(num_tokens,)](
        x, res, weight, out, summed, x.stride(0), res.stride(0), out.stride(0), summed.stride(0), hidden,
        float(eps), HAS_RESIDUAL=residual is not None, IS_UNIT_OFFSET=is_unit_offset, BLOCK=block,
        num_warps=_norm_warps(block))
    return out, summed


# ---- RMSNorm of each q/k head (reference) ---------------------------------------------------------------------


@dataclass(frozen=True)
class HeadNorms:
    """Qwen3's and Gemma 3's RMSNorm of each q and k head over head_dim, before RoPE (`head_rms_norm_torch_`)."""

    q_weight: torch.Tensor  # [head_dim]
    k_weight: torch.Tensor  # [head_dim]
    eps: float
    is_unit_offset: bool  # Gemma 3: scale by (1 + weight)


def head_rms_norm_torch_(x: torch.Tensor, weight: torch.Tensor, eps: float, is_unit_offset: bool = False) -> None:
    """Reference, in place: each head x[t, h] <- `rms_norm_torch(x[t, h], weight, eps, is_unit_offset)`.

    x: [num_tokens, num_heads, head_dim] (a view of a fused qkv output allowed); weight: [head_dim]. The Triton
    version runs inside `rotary_kv_cache_` (its `norms`).
    """
    x.copy_(rms_norm_torch(x, weight, eps, is_unit_offset))


# ---- SiLU x mul and GeGLU ---------------------------------------------------------------------------------------


def silu_mul_torch(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: out = silu(gate) * up with gate, up = gate_up.chunk(2, -1).

    gate_up: [num_tokens, 2 * inter]; out: [num_tokens, inter] (optional, written in place). silu is computed in
    float32 and rounded to the dtype, then the product is rounded again, as `F.silu(gate) * up` does.
    """
    gate, up = gate_up.chunk(2, dim=-1)
    result = torch.nn.functional.silu(gate) * up
    return result if out is None else out.copy_(result)


def gelu_tanh_mul_torch(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: out = gelu_tanh(gate) * up with gate, up = gate_up.chunk(2, -1) (transformers' GeGLU,
    `gelu_pytorch_tanh`): gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))).

    Shapes and roundings as `silu_mul_torch` (the activation rounded to the dtype, then the product).
    """
    gate, up = gate_up.chunk(2, dim=-1)
    result = torch.nn.functional.gelu(gate, approximate="tanh") * up
    return result if out is None else out.copy_(result)


@triton.jit
def _act_mul_kernel(gate_up_ptr, out_ptr, gate_up_stride, out_stride, inter, IS_GELU: tl.constexpr,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gate_up_ptr + row * gate_up_stride + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * gate_up_stride + inter + cols, mask=mask, other=0.0)
    gate32 = gate.to(tl.float32)
    # silu(x) = x / (1 + exp(-x)); gelu_tanh(x) = 0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)), which keeps its
    # precision where the gate is negative (no 1 + tanh cancellation). IEEE division as torch's (Triton's `/` is
    # div.full, 2 ulp); the activation is rounded before the mul, as torch rounds it.
    exponent = gate32
    if IS_GELU:
        exponent = 1.5957691216057308 * (gate32 + 0.044715 * gate32 * gate32 * gate32)  # 2u, 2 sqrt(2 / pi) = 1.5957...
    act = tl.math.div_rn(gate32, 1.0 + tl.exp(-exponent)).to(gate.dtype)
    out = (act.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_stride + cols, out, mask=mask)


def _silu_block(num_tokens: int) -> int:
    """Columns per program: narrow for decode (more programs over the SMs), 1024 once rows fill the GPU."""
    return 256 if num_tokens < 64 else 1024


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton: out = silu(gate) * up with gate, up = gate_up.chunk(2, -1).

    Same arguments and roundings as `silu_mul_torch`. Triton's float32 exp (ex2.approx on CUDA) is a few float32
    ulp off torch's expf, so silu's rounding to bf16/fp16 flips on rare elements: at most 1 ulp there.
    Grid: rows x column blocks.
    """
    return _launch_act_mul(gate_up, out, is_gelu=False)


def gelu_tanh_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton: out = gelu_tanh(gate) * up with gate, up = gate_up.chunk(2, -1).

    Same arguments and roundings as `gelu_tanh_mul_torch`, within a few float32 ulp of its activation before the
    rounding (as `silu_mul`). Grid: rows x column blocks.
    """
    return _launch_act_mul(gate_up, out, is_gelu=True)


def _launch_act_mul(gate_up: torch.Tensor, out: torch.Tensor | None, is_gelu: bool) -> torch.Tensor:
    _check_device(gate_up)
    num_tokens, width = gate_up.shape
    inter = width // 2
    assert gate_up.dtype in FLOAT_DTYPES and width == 2 * inter and gate_up.stride(1) == 1
    out = torch.empty((num_tokens, inter), dtype=gate_up.dtype, device=gate_up.device) if out is None else out
    assert out.shape == (num_tokens, inter) and out.stride(1) == 1
    if num_tokens == 0:
        return out
    block = min(_silu_block(num_tokens), triton.next_power_of_2(inter))
    grid = (num_tokens, triton.cdiv(inter, block))
    _act_mul_kernel[grid](gate_up, out, gate_up.stride(0), out.stride(0), inter, IS_GELU=is_gelu, BLOCK=block,
                          num_warps=max(block // 256, 1))
    return out


# ---- rotary embedding in place ---------------------------------------------------------------------------------


def rotary_torch_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                  attention_scaling: float) -> None:
    """Reference, in place: x <- x * cos + rotate_half(x) * sin for x in (q, k), at angles positions x inv_freq.

    q: [num_tokens, num_heads, head_dim]; k: [num_tokens, num_kv_heads, head_dim] (views allowed); positions:
    [num_tokens] integer; inv_freq: [head_dim // 2] float32. cos and sin are computed in float32 over
    cat(freqs, freqs), scaled by attention_scaling and cast to q's dtype; the rotation runs in that dtype.
    """
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = (emb.cos() * attention_scaling).to(q.dtype)[:, None, :]
    sin = (emb.sin() * attention_scaling).to(q.dtype)[:, None, :]
    for x in (q, k):
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        x.copy_(x * cos + rotated * sin)


@triton.jit
def rotary_cos_sin(freqs, attention_scaling, dtype):
    """cos and sin of the angles, scaled and rounded to dtype (then held in float32), as `rotary_torch_` has them."""
    cos = (tl.cos(freqs) * attention_scaling).to(dtype).to(tl.float32)
    sin = (tl.sin(freqs) * attention_scaling).to(dtype).to(tl.float32)
    return cos, sin


@triton.jit
def rotate_rounded(x, partner, cos, sin, sign, dtype):
    """One half of rotated heads in dtype: x * cos + sign * partner * sin, each product rounded to dtype before the
    sum as apply_rotary's three eager ops round them. The first half takes sign -1 and the second half as partner;
    the second half sign +1 and the first half. x, partner: float32 values of dtype."""
    return ((x * cos).to(dtype).to(tl.float32) + sign * (partner * sin).to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _rotate_heads(x_ptr, out_ptr, first_head, num_heads, head_stride, out_head_stride, cos, sin, half,
                  norm_ptr, eps, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, HAS_NORM: tl.constexpr,
                  IS_UNIT_OFFSET: tl.constexpr):
    """Rotates heads [first_head, first_head + BLOCK_H) of one token's row at x_ptr into out_ptr (may be x_ptr);
    HAS_NORM: each head RMS-normed over head_dim by the [head_dim] weight at norm_ptr first (`head_rms_norm_torch_`,
    rounded to the dtype as it is before the rotation)."""
    heads = first_head + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (cols[None, :] < half)
    ptrs = x_ptr + heads[:, None].to(tl.int64) * head_stride + cols[None, :]
    out_ptrs = out_ptr + heads[:, None].to(tl.int64) * out_head_stride + cols[None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0)
    x2 = tl.load(ptrs + half, mask=mask, other=0.0)
    dtype = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * half) + eps)[:, None]
        w1 = tl.load(norm_ptr + cols, mask=cols < half, other=0.0)[None, :]
        w2 = tl.load(norm_ptr + half + cols, mask=cols < half, other=0.0)[None, :]
        x1 = _scale_normed(x1 * rstd, w1, dtype, IS_UNIT_OFFSET).to(dtype).to(tl.float32)
        x2 = _scale_normed(x2 * rstd, w2, dtype, IS_UNIT_OFFSET).to(dtype).to(tl.float32)
    tl.store(out_ptrs, rotate_rounded(x1, x2, cos, sin, -1.0, dtype), mask=mask)
    tl.store(out_ptrs + half, rotate_rounded(x2, x1, cos, sin, 1.0, dtype), mask=mask)


@triton.jit
def _copy_heads(x_ptr, out_ptr, first_head, num_heads, head_stride, out_head_stride, head_dim,
                BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    heads = first_head + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_heads) & (cols[None, :] < head_dim)
    x = tl.load(x_ptr + heads[:, None].to(tl.int64) * head_stride + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + heads[:, None].to(tl.int64) * out_head_stride + cols[None, :], x, mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, v_ptr, positions_ptr, inv_freq_ptr, key_cache_ptr, value_cache_ptr, slots_ptr,
                   attention_scaling, q_token_stride, q_head_stride, k_token_stride, k_head_stride, v_token_stride,
                   v_head_stride, cache_slot_stride, cache_head_stride, num_heads, num_kv_heads, half,
                   skip_ptr, q_norm_ptr, k_norm_ptr, eps, HAS_CACHE: tl.constexpr, SKIP_ADAPTED: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, HAS_NORM: tl.constexpr,
                   IS_UNIT_OFFSET: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    num_q_blocks = tl.cdiv(num_heads, BLOCK_H)
    num_rotated_blocks = num_q_blocks + tl.cdiv(num_kv_heads, BLOCK_H)
    slot = tl.load(slots_ptr + token).to(tl.int64)  # without HAS_CACHE: a position, unused
    cols = tl.arange(0, BLOCK_HALF)
    inv_freq = tl.load(inv_freq_ptr + cols, mask=cols < half, other=0.0)
    freqs = tl.load(positions_ptr + token).to(tl.float32) * inv_freq
    # cat(freqs, freqs): both halves of a head share one angle, so one [half] row of cos and sin serves both.
    dtype = q_ptr.dtype.element_ty
    cos, sin = rotary_cos_sin(freqs[None, :], attention_scaling, dtype)
    is_skipped = False
    if SKIP_ADAPTED:  # the token has an adapter: kernels/lora_rotary.py rotates and stores its heads
        is_skipped = tl.load(skip_ptr + token) >= 0
    if is_skipped:
        pass
    elif block < num_q_blocks:
        q_row = q_ptr + token * q_token_stride
        _rotate_heads(q_row, q_row, block * BLOCK_H, num_heads, q_head_stride, q_head_stride, cos, sin, half,
                      q_norm_ptr, eps, BLOCK_H, BLOCK_HALF, HAS_NORM, IS_UNIT_OFFSET)
    elif block < num_rotated_blocks:
        k_row = k_ptr + token * k_token_stride
        first = (block - num_q_blocks) * BLOCK_H
        if HAS_CACHE:  # the rotated k goes straight into the key cache; k itself is left as it was
            if slot >= 0:
                _rotate_heads(k_row, key_cache_ptr + slot * cache_slot_stride, first, num_kv_heads, k_head_stride,
                              cache_head_stride, cos, sin, half, k_norm_ptr, eps, BLOCK_H, BLOCK_HALF, HAS_NORM,
                              IS_UNIT_OFFSET)
        else:
            _rotate_heads(k_row, k_row, first, num_kv_heads, k_head_stride, k_head_stride, cos, sin, half,
                          k_norm_ptr, eps, BLOCK_H, BLOCK_HALF, HAS_NORM, IS_UNIT_OFFSET)
    elif slot >= 0:  # HAS_CACHE only: v copied into the value cache as it is
        _copy_heads(v_ptr + token * v_token_stride, value_cache_ptr + slot * cache_slot_stride,
                    (block - num_rotated_blocks) * BLOCK_H, num_kv_heads, v_head_stride, cache_head_stride, 2 * half,
                    BLOCK_H, 2 * BLOCK_HALF)


def _rotary_heads_per_program(num_tokens: int, num_heads: int) -> int:
    """One head per program for decode-sized batches (more programs over the SMs), 4 once tokens fill the GPU."""
    return min(1 if num_tokens < 64 else 4, triton.next_power_of_2(num_heads))


def _check_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> None:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    half = head_dim // 2
    assert q.dtype in FLOAT_DTYPES and k.dtype == q.dtype and head_dim == 2 * half
    assert k.shape == (num_tokens, num_kv_heads, head_dim) and q.stride(2) == 1 and k.stride(2) == 1
    assert positions.shape == (num_tokens,) and positions.stride(0) == 1 and not positions.is_floating_point()
    assert inv_freq.shape == (half,) and inv_freq.dtype == torch.float32 and inv_freq.stride(0) == 1


def rotary_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
            attention_scaling: float) -> None:
    """Triton, in place: x <- x * cos + rotate_half(x) * sin for x in (q, k), at angles positions x inv_freq.

    Same arguments and roundings as `rotary_torch_`; q and k may be strided views (of a fused qkv output) with
    contiguous head_dim. cos/sin: libdevice's float32 cosf/sinf on CUDA (numpy's under the interpreter), accurate
    over the whole range of positions x inv_freq, so within 1 ulp of the rounded products everywhere.
    One launch: a program per (token, block of q or k heads).
    """
    _check_device(q)
    _check_rotary(q, k, positions, inv_freq)
    if q.shape[0] == 0:
        return
    _launch_rotary(q, k, None, positions, inv_freq, attention_scaling, None, None, None)


def _launch_rotary(q, k, v, positions, inv_freq, attention_scaling, key_cache, value_cache, slot_mapping,
                   skip_adapted: torch.Tensor | None = None, norms: HeadNorms | None = None) -> None:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    half = head_dim // 2
    has_cache = key_cache is not None
    block_h = _rotary_heads_per_program(num_tokens, max(num_heads, num_kv_heads))
    block_half = triton.next_power_of_2(half)
    num_kv_blocks = triton.cdiv(num_kv_heads, block_h)
    grid = (num_tokens, triton.cdiv(num_heads, block_h) + num_kv_blocks * (2 if has_cache else 1))
    v_arg, caches = (v, (key_cache, value_cache, slot_mapping)) if has_cache else (k, (k, k, positions))
    cache_strides = (key_cache.stride(-3), key_cache.stride(-2)) if has_cache else (0, 0)
    _rotary_kernel[grid](q, k, v_arg, positions, inv_freq, *caches, float(attention_scaling), q.stride(0),
                         q.stride(1), k.stride(0), k.stride(1), v_arg.stride(0), v_arg.stride(1), *cache_strides,
                         num_heads, num_kv_heads, half, positions if skip_adapted is None else skip_adapted,
                         inv_freq if norms is None else norms.q_weight, inv_freq if norms is None else norms.k_weight,
                         0.0 if norms is None else float(norms.eps), HAS_CACHE=has_cache,
                         SKIP_ADAPTED=skip_adapted is not None, BLOCK_H=block_h, BLOCK_HALF=block_half,
                         HAS_NORM=norms is not None, IS_UNIT_OFFSET=norms is not None and norms.is_unit_offset,
                         num_warps=max(min(block_h * block_half // 256, 4), 1))


# ---- rotary embedding with the KV-cache write ------------------------------------------------------------------


def rotary_kv_cache_torch_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                           inv_freq: torch.Tensor, attention_scaling: float, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           norms: HeadNorms | None = None) -> None:
    """Reference: q rotated in place as `rotary_torch_` rotates it; the rotated k and v stored at their flat cache
    slots (`engine/model/attention.py: write_kv`); k and v themselves are left as they were. norms: q and k heads
    normed first (`head_rms_norm_torch_`), q in place.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]; key_cache, value_cache:
    [num_blocks, block_size, num_kv_heads, head_dim]; slot_mapping: [num_tokens] integer, flat slot
    (block * block_size + offset) of each token; a negative slot writes nothing.
    """
    rotated_k = k.clone()
    if norms is not None:
        head_rms_norm_torch_(q, norms.q_weight, norms.eps, norms.is_unit_offset)
        head_rms_norm_torch_(rotated_k, norms.k_weight, norms.eps, norms.is_unit_offset)
    rotary_torch_(q, rotated_k, positions, inv_freq, attention_scaling)
    num_kv_heads, head_dim = k.shape[1:]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    key_cache.view(-1, num_kv_heads, head_dim)[slots] = rotated_k[keep]
    value_cache.view(-1, num_kv_heads, head_dim)[slots] = v[keep]


def rotary_kv_cache_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     inv_freq: torch.Tensor, attention_scaling: float, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     skip_adapted: torch.Tensor | None = None, norms: HeadNorms | None = None) -> None:
    """Triton: `rotary_kv_cache_torch_` in one launch (the q/k norms, the rotary and the two cache writes of a
    layer).

    skip_adapted: [num_tokens] token -> adapter slot (`LoRAStep.token_slots`): tokens with a slot >= 0 are left as
    they are (`kernels/lora_rotary.py` adds their LoRA delta, rotates and stores them in its own launch).

    Same arguments and roundings; q, k, v may be strided views of a fused qkv output (contiguous head_dim); the
    caches are contiguous in their last two dimensions. A program per (token, block of q, k or v heads); the k
    programs store the rotated heads in the key cache instead of back into k. Distinct tokens must have distinct
    slots (as the scheduler's slot mappings do), else which token's K/V a shared slot keeps is unspecified.
    """
    _check_device(q)
    _check_rotary(q, k, positions, inv_freq)
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and v.dtype == q.dtype and v.stride(2) == 1
    for cache in (key_cache, value_cache):
        assert cache.dtype == q.dtype and cache.shape[-2:] == (num_kv_heads, head_dim)
        assert cache.stride(-1) == 1 and cache.stride(-2) == head_dim and cache.stride() == key_cache.stride()
    assert key_cache.stride(-3) == num_kv_heads * head_dim and key_cache.is_contiguous()
    assert slot_mapping.shape == (num_tokens,) and not slot_mapping.is_floating_point()
    assert skip_adapted is None or (skip_adapted.shape == (num_tokens,) and skip_adapted.dtype == torch.int64)
    assert norms is None or (skip_adapted is None and norms.q_weight.shape == norms.k_weight.shape == (head_dim,)
                             and norms.q_weight.stride(0) == norms.k_weight.stride(0) == 1)
    if num_tokens == 0:
        return
    _launch_rotary(q, k, v, positions, inv_freq, attention_scaling, key_cache, value_cache, slot_mapping,
                   skip_adapted, norms)
