"""The decoder of every served family (Llama 2/3, Mistral, Qwen2/3, Gemma 2/3, Phi-3/4) over a paged KV cache, with
batched multi-LoRA. A family is the Llama layer with the switches of its `Family` (engine/model/config.py): norms
with (1 + w), q/k norms, post-norms, GeGLU, scaled embeddings, per-layer windows and RoPE, soft-caps.

One forward runs every scheduled token of the step as one flat batch `[num_tokens, hidden]`. Each adaptable
projection (fused qkv, o, fused gate_up, down) computes its base output and then calls the batched LoRA op
once for the whole batch with the step's shared metadata. The residual stream is carried beside the hidden
state so that each residual add is fused with the RMSNorm after it; on CUDA the small ops (residual add +
RMSNorm, SiLU x mul, rotary with the KV-cache write) are one Triton launch each (kernels/fused.py), elsewhere
their PyTorch references, which compute what transformers computes. On CUDA a step of one
token (decode at batch 1) runs its projections as weight-streaming Triton GEMVs (kernels/gemv.py) instead of
cuBLAS; `use_gemv=False` (EngineConfig) keeps cuBLAS.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kubelora.engine.model.attention import AttentionMetadata, KVCache, paged_attention, write_kv
from kubelora.engine.model.config import ModelConfig
from kubelora.engine.model.quantized import Fp8Linear
from kubelora.engine.model.rope import RotaryEmbedding, apply_rotary
from kubelora.engine.model.weights import ModelWeights
from kubelora.kernels import fused, gemv
from kubelora.kernels.lora import LoRAOps, LoRAProj, LoRAStep, add_lora
from kubelora.kernels.lora_formats import add_embed_lora_, add_lm_head_lora_
from kubelora.kernels.lora_rotary import add_lora_rotary_kv_cache_, is_expand_rotary


@dataclass(frozen=True)
class LayerLoRABuffers:
    """One layer's view of the device adapter pool: kind -> per-slice buffers (see kernels/lora.py)."""

    lora_a: dict[str, list[torch.Tensor]]  # kind -> [num_rows, in_dim] per slice
    lora_b: dict[str, list[torch.Tensor]]  # kind -> [num_rows, out_dim_s] per slice (DoRA's output scales too)
    # embed_tokens, lm_head -> (A, B^T) rows over every layer's strip, [num_layers, num_rows, piece] (the same in
    # every layer's entry: a vocabulary-wide module's rows are cut in pieces, one per layer)
    vocab: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


@dataclass(frozen=True)
class LoRAContext:
    """How the step's layers apply LoRA: its token map, each kind's slot table, the backend's ops and, from the
    step's shape, the kinds whose shrink is staged into the base matmul."""

    step: LoRAStep
    proj: dict[str, LoRAProj]  # kind -> slot table: each projection kind's, then "embed" and "lm_head"
    ops: LoRAOps
    # kind -> staged rows its matmul reads past the base output (engine/adapters/staging.py; triton backend):
    # those kinds compute their shrink in the base matmul and launch only the expand
    stage: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ForwardContext:
    """Everything a layer needs for one step: views of the step's inputs (engine/step/inputs.py), shared by every
    layer."""

    attention: AttentionMetadata
    positions: torch.Tensor  # [num_tokens] int64
    lora: LoRAContext | None  # None: no token of the step has an adapter


_ACTIVATIONS = {"silu": (fused.silu_mul, fused.silu_mul_torch),  # (Triton op, its reference) per hidden_act
                "gelu_pytorch_tanh": (fused.gelu_tanh_mul, fused.gelu_tanh_mul_torch)}
# The step's rotary angles on the reference path, per distinct RotaryEmbedding (id -> (cos, sin), each
# [num_tokens, head_dim]); empty on the fused path, which computes them per launch.
_Angles = dict[int, tuple[torch.Tensor, torch.Tensor]]


class DecoderModel:
    def __init__(self, config: ModelConfig, weights: ModelWeights, ropes: list[RotaryEmbedding], kv_cache: KVCache,
                 lora_buffers: list[LayerLoRABuffers], use_gemv: bool = True) -> None:
        """ropes: each layer's rotary embedding (layers of one RoPE share the object)."""
        self.config = config
        self.family = config.family
        self.weights = weights
        self.ropes = ropes
        self.kv_cache = kv_cache
        self.lora_buffers = lora_buffers
        self.is_fused = weights.embed.is_cuda  # Triton small ops (kernels/fused.py) on CUDA
        self.is_gemv = self.is_fused and use_gemv  # Triton GEMVs for one-token steps (kernels/gemv.py) on CUDA
        # Gemma: sqrt(hidden) rounded to the dtype first, as transformers rounds it; a product with a Python float
        # of that value rounds as the product with a 0-d tensor of the dtype does
        self.embed_scale = None
        if self.family.is_embed_scaled:
            self.embed_scale = torch.tensor(config.hidden_size**0.5).to(self.dtype).item()
        # Qwen3, Gemma 3: each layer's q/k norms, applied by the rotary launch (or their reference)
        self.head_norms = [fused.HeadNorms(layer.norm["q"], layer.norm["k"], config.rms_norm_eps,
                                           self.family.is_unit_offset_norm) for layer in weights.layers
                           ] if self.family.has_qk_norm else None

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.embed.dtype

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """token_ids: [num_tokens] -> final hidden states [num_tokens, hidden]."""
        angles: _Angles = {}
        if not self.is_fused:
            distinct = {id(rope): rope for rope in self.ropes}
            angles = {key: rope.cos_sin(ctx.positions, self.dtype) for key, rope in distinct.items()}
        hidden, residual = F.embedding(token_ids, self.weights.embed), None
        if self._is_adapted(ctx.lora, "embed"):  # before the scale, which PEFT applies to the adapter's output too
            add_embed_lora_(hidden, token_ids, self.lora_buffers[0].vocab["embed_tokens"], ctx.lora.proj["embed"],
                            ctx.lora.step)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        for layer in range(self.config.num_layers):
            hidden, residual = self._layer(layer, hidden, residual, ctx, angles)
        return self._add_norm(hidden, residual, self.weights.final_norm)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, lora: LoRAContext | None = None,
                       rows: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [n, hidden] -> logits [n, vocab] float32 (soft-capped in the model's dtype, as transformers);
        lora: the step's, whose lm_head adapters add their deltas to the rows' logits; rows: the step's token rows
        hidden holds (None: every row)."""
        logits = F.linear(hidden, self.weights.lm_head)
        if self._is_adapted(lora, "lm_head"):
            slots = lora.step.token_slots if rows is None else lora.step.token_slots.index_select(0, rows)
            add_lm_head_lora_(logits, hidden, slots, self.lora_buffers[0].vocab["lm_head"], lora.proj["lm_head"],
                              lora.step.num_slots)
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    @staticmethod
    def _is_adapted(lora: LoRAContext | None, kind: str) -> bool:
        return lora is not None and kind in lora.proj and any(lora.proj[kind].max_rank)

    def _add_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                  weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual); residual None: the first layer's input is the residual."""
        op = fused.add_rms_norm if self.is_fused else fused.add_rms_norm_torch
        return op(x, residual, weight, self.config.rms_norm_eps, is_unit_offset=self.family.is_unit_offset_norm)

    def _layer(self, layer: int, delta: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext,
               angles: _Angles) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output delta and the residual stream it adds to (summed by the next norm)."""
        norms = self.weights.layers[layer].norm
        x, residual = self._add_norm(delta, residual, norms["input"])
        attn = self._proj(layer, "o", self._attention(layer, x, ctx, angles), ctx)
        if self.family.has_post_norms:
            attn = self._add_norm(attn, None, norms["attn_out"])[0]
        x, residual = self._add_norm(attn, residual, norms["pre_mlp"])
        gate_up = self._proj(layer, "gate_up", x, ctx)
        op, reference = _ACTIVATIONS[self.config.hidden_act]
        out = self._proj(layer, "down", op(gate_up) if self.is_fused else reference(gate_up), ctx)
        if self.family.has_post_norms:
            out = self._add_norm(out, None, norms["mlp_out"])[0]
        return out, residual

    def _attention(self, layer: int, x: torch.Tensor, ctx: ForwardContext, angles: _Angles) -> torch.Tensor:
        """x: [num_tokens, hidden] -> attention output before o_proj [num_tokens, num_heads * head_dim]."""
        cfg = self.config
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        key_cache, value_cache = self.kv_cache.key[layer], self.kv_cache.value[layer]
        rope = self.ropes[layer]
        lora = ctx.lora
        # the LoRA-rotary launch rotates the projection's output as it adds the delta: no room for q/k norms
        # nor for DoRA's output scale, which applies before the rotation
        if (self.is_fused and not self.family.has_qk_norm and lora is not None and lora.ops.name == "triton"
                and lora.proj["qkv"].dora_row is None and is_expand_rotary(lora.proj["qkv"], lora.step, cfg.head_dim)):
            q = self._lora_rotary_q(layer, x, ctx, key_cache, value_cache)
        else:
            q, k, v = self._proj(layer, "qkv", x, ctx).split([q_dim, kv_dim, kv_dim], dim=-1)
            q = q.view(-1, cfg.num_heads, cfg.head_dim)
            k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
            v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
            norms = self.head_norms[layer] if self.head_norms is not None else None
            if self.is_fused:  # one launch: q normed and rotated in place, the normed rotated k and v in the cache
                fused.rotary_kv_cache_(q, k, v, ctx.positions, rope.inv_freq, rope.attention_scaling,
                                       key_cache, value_cache, ctx.attention.slot_mapping, norms=norms)
            else:
                if norms is not None:  # in place on the projection's output
                    fused.head_rms_norm_torch_(q, norms.q_weight, norms.eps, norms.is_unit_offset)
                    fused.head_rms_norm_torch_(k, norms.k_weight, norms.eps, norms.is_unit_offset)
                cos, sin = angles[id(rope)]
                q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
                write_kv(key_cache, value_cache, k, v, ctx.attention.slot_mapping)
        return paged_attention(q, key_cache, value_cache, ctx.attention, cfg.sliding_windows[layer],
                               cfg.attention_scale, cfg.attn_logit_softcap)

    def _lora_rotary_q(self, layer: int, x: torch.Tensor, ctx: ForwardContext, key_cache: torch.Tensor,
                       value_cache: torch.Tensor) -> torch.Tensor:
        """A prefill's q/k/v projection with its LoRA deltas added by the rotary launch (kernels/lora_rotary.py:
        no second pass over the projection's output); K and V go to the caches; returns the rotated q."""
        cfg, lora = self.config, ctx.lora
        weights, buffers = self.weights.layers[layer], self.lora_buffers[layer]
        qkv = self._linear(x, weights.weight["qkv"], weights.bias["qkv"])
        add_lora_rotary_kv_cache_(qkv, x, buffers.lora_a["qkv"], buffers.lora_b["qkv"], lora.proj["qkv"], lora.step,
                                  cfg.num_heads, cfg.num_kv_heads, ctx.positions, self.ropes[layer].inv_freq,
                                  self.ropes[layer].attention_scaling, key_cache, value_cache,
                                  ctx.attention.slot_mapping)
        return qkv[:, : cfg.num_heads * cfg.head_dim].view(-1, cfg.num_heads, cfg.head_dim)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor | Fp8Linear, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T + b: an FP8 weight's own matmul (engine/model/quantized.py); else a single-row Triton GEMV for
        one-token steps on CUDA (unless use_gemv is off), else cuBLAS."""
        if isinstance(weight, Fp8Linear):
            return weight(x, bias)
        if self.is_gemv and x.shape[0] == 1:
            return gemv.linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def _proj(self, layer: int, kind: str, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """y = x W^T + b, then the batch's LoRA deltas added in place by one batched op."""
        weights = self.weights.layers[layer]
        lora = ctx.lora
        staged = lora.stage.get(kind, 0) if lora is not None else 0
        if staged:  # x @ [W; the step's A rows]^T, then the expand reads each token's shrink from its row
            weight, bias = weights.extended[kind]
            width = weights.weight[kind].shape[0]
            y = self._linear(x, weight[: width + staged], None if bias is None else bias[: width + staged])
            lora.ops.add_staged(y, width, self.lora_buffers[layer].lora_b[kind], lora.proj[kind], lora.step,
                                bias=weights.bias[kind])
            return y[:, :width]
        y = self._linear(x, weights.weight[kind], weights.bias[kind])
        if lora is not None:  # DoRA's output scale, where a slot has one, in the same op (the expand's store)
            buffers = self.lora_buffers[layer]
            add_lora(y, x, buffers.lora_a[kind], buffers.lora_b[kind], lora.proj[kind], lora.step, backend=lora.ops,
                     bias=weights.bias[kind])
        return y
