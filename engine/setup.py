"""Derived sizes and component construction for LLMEngine (values are returned, never written to config)."""

from __future__ import annotations

import logging
import math

import torch

from kubelora.engine.adapters.pool import DeviceLoRAPool, table_modules
from kubelora.engine.adapters.staging import ROWS_PER_SLICE, STAGED_KINDS, ShrinkStaging
from kubelora.engine.config import DEFAULT_CPU_LORAS, EngineConfig
from kubelora.engine.model.attention import KVCache
from kubelora.engine.model.config import ModelConfig, rope_inv_freq
from kubelora.engine.model.llama import DecoderModel
from kubelora.engine.model.rope import RotaryEmbedding
from kubelora.engine.step.executor import StepExecutor
from kubelora.engine.step.inputs import StepInputs
from kubelora.engine.step.shape import prefill_buckets

log = logging.getLogger(__name__)
CPU_KV_CAP_BYTES = 4 << 30


def resolve_dtype(config: EngineConfig) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if config.device.startswith("cuda") else torch.float32
    return getattr(torch, config.dtype)


def resolve_max_model_len(config: EngineConfig, model: ModelConfig) -> int:
    if config.max_model_len is None:
        return model.max_position_embeddings
    if config.max_model_len > model.max_position_embeddings:
        raise ValueError(f"max_model_len must be <= the model's max_position_embeddings "
                         f"({model.max_position_embeddings}), got {config.max_model_len}")
    return config.max_model_len


def resolve_lora_backend(config: EngineConfig) -> str:
    if config.lora_backend is not None:
        return config.lora_backend
    from kubelora.kernels.lora import default_backend

    return default_backend(config.device)


def pool_rows(config: EngineConfig, model: ModelConfig, dtype: torch.dtype, device: torch.device) -> int:
    """Rank rows per module: the byte budget divided by the bytes of one rank row of every module.

    Call after the weights are on the device: the CUDA default is a share of the memory they leave free.
    """
    per_rank = DeviceLoRAPool.bytes_per_rank(model, dtype)
    budget = _set_pool_budget(config, per_rank)
    if budget is None and device.type == "cuda":
        budget = int(torch.cuda.mem_get_info(device)[0] * config.lora_pool_fraction)
    elif budget is None:
        budget = DEFAULT_CPU_LORAS * config.max_lora_rank * per_rank
    rows = budget // per_rank
    if rows < 1:
        raise ValueError(f"max_lora_pool_bytes must hold at least one rank row of every module "
                         f"({per_rank} bytes), got {budget}")
    return rows


def _set_pool_budget(config: EngineConfig, per_rank: int) -> int | None:
    """The pool's bytes where the config fixes them (max_lora_pool_bytes, else max_loras x max_lora_rank rows);
    None where they follow the device's free memory."""
    if config.max_lora_pool_bytes is not None:
        return config.max_lora_pool_bytes
    if config.max_loras is not None:
        return config.max_loras * config.max_lora_rank * per_rank
    return None


def kv_block_bytes(config: EngineConfig, model: ModelConfig, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * config.kv_block_size * model.num_kv_heads * model.head_dim * element


def num_kv_blocks(config: EngineConfig, model: ModelConfig, dtype: torch.dtype, max_model_len: int,
                  device: torch.device) -> int:
    block_bytes = kv_block_bytes(config, model, dtype)
    needed = math.ceil(max_model_len / config.kv_block_size)
    wanted = config.max_num_seqs * needed
    if config.num_kv_blocks is not None:
        blocks = config.num_kv_blocks
    elif config.kv_cache_bytes is not None:
        blocks = config.kv_cache_bytes // block_bytes
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        blocks = min(wanted, int(free * config.gpu_memory_utilization) // block_bytes)
    else:
        blocks = min(wanted, CPU_KV_CAP_BYTES // block_bytes)
    if blocks < needed:
        raise ValueError(f"the KV cache must hold one max_model_len sequence ({needed} blocks of "
                         f"{config.kv_block_size} tokens); num_kv_blocks/kv_cache_bytes give {blocks}")
    return blocks


def allocate_kv_cache(config: EngineConfig, model: ModelConfig, dtype: torch.dtype, blocks: int,
                      device: torch.device) -> KVCache:
    return KVCache.allocate(model.num_layers, blocks, config.kv_block_size, model.num_kv_heads, model.head_dim,
                            dtype, device)


def build_ropes(hf_config, model: ModelConfig, max_model_len: int, device: torch.device) -> list[RotaryEmbedding]:
    """Each layer's rotary embedding: one per set of RoPE parameters (Gemma 3: one for its full layers, one for its
    sliding ones), shared by the layers that use it. max_model_len picks longrope's factors (`rope_inv_freq`)."""
    keys = model.rope_types or (None,) * model.num_layers
    ropes = {key: RotaryEmbedding(*rope_inv_freq(hf_config, max_model_len, key), device) for key in set(keys)}
    return [ropes[key] for key in keys]


def uses_static_steps(config: EngineConfig) -> bool:
    """Decode steps and short prefill chunks padded to static shapes (engine/step/executor.py) unless enforce_eager,
    on every device: CUDA replays their graphs, elsewhere the same inputs run eagerly, so the CPU suite runs what
    CUDA replays."""
    return not config.enforce_eager


def uses_staged_shrink(config: EngineConfig) -> bool:
    """LoRA decode steps compute their shrink in the base matmul (engine/adapters/staging.py): on the static decode
    path with the Triton LoRA backend, unless use_staged_shrink is off."""
    return uses_static_steps(config) and resolve_lora_backend(config) == "triton" and config.use_staged_shrink


def staged_rows(config: EngineConfig, model: ModelConfig, dtype: torch.dtype) -> dict[str, int]:
    """Staging capacity per staged kind, in rows per module: what one decode step's adapters can take, at most
    ROWS_PER_SLICE. A step's adapters hold at most max_num_seqs x max_lora_rank rank rows, and never more than the
    device pool's rows where the config fixes the pool's size (the default pool, a share of free memory, holds
    more than ROWS_PER_SLICE at the 7B shape). No kind over FP8 base weights: their matmul cannot take bf16 A rows."""
    if model.quantization is not None:
        return {}
    per_rank = DeviceLoRAPool.bytes_per_rank(model, dtype)
    per_module = min(ROWS_PER_SLICE, config.max_num_seqs * config.max_lora_rank)
    budget = _set_pool_budget(config, per_rank)
    if budget is not None:
        per_module = min(per_module, max(1, budget // per_rank))
    return {kind: per_module * len(model.kind_modules(kind)) for kind in STAGED_KINDS}


def build_step_executor(config: EngineConfig, model: DecoderModel, max_model_len: int, pad_block: int,
                        lora_backend: str, use_graphs: bool | None = None,
                        staging: ShrinkStaging | None = None) -> StepExecutor:
    """The step executor over its two step inputs: decode steps (max_num_seqs sequences of one token) and the
    rest (up to the step budget; short prefill chunks static unless use_prefill_graphs is off). Graphs: by default
    on CUDA, never with enforce_eager; the base-model ones are captured by `capture_base`."""
    device = torch.device(config.device)
    is_static = uses_static_steps(config)
    max_blocks = math.ceil(max_model_len / config.kv_block_size)
    kind_slices = {kind: len(modules) for kind, modules in table_modules(model.config).items()}  # slot tables' width
    shared = dict(max_seqs=config.max_num_seqs, max_blocks=max_blocks, block_size=config.kv_block_size,
                  pad_block=pad_block, kind_slices=kind_slices, device=device)
    decode = StepInputs(max_tokens=config.max_num_seqs, **shared,
                        staged_kinds=tuple(staging.modules) if staging is not None else ())
    prefill_top = prefill_buckets(config.max_num_batched_tokens)[-1] if config.use_prefill_graphs else 0
    general_tokens = max(config.max_num_batched_tokens, config.max_num_seqs, prefill_top)
    # the start-up warm-up's steps are one sequence of up to the step budget, past max_model_len where it is shorter
    general = StepInputs(max_tokens=general_tokens, **{**shared, "max_blocks": max(
        max_blocks, math.ceil(general_tokens / config.kv_block_size))})
    use_graphs = is_static and (device.type == "cuda" if use_graphs is None else use_graphs)
    return StepExecutor(model, decode, general, lora_backend, use_graphs=use_graphs, is_static=is_static,
                        prefill_max_tokens=prefill_top, staging=staging)


def capture_base(steps: StepExecutor, device: torch.device) -> None:
    """Capture the base-model graph of every bucket now (start-up, not a request), its time and (CUDA) device
    memory logged."""
    is_cuda = device.type == "cuda"
    free_before = torch.cuda.mem_get_info(device)[0] if is_cuda else 0
    steps.capture_base()
    used = free_before - torch.cuda.mem_get_info(device)[0] if is_cuda else 0
    buckets = {phase.value: steps.buckets(phase) for phase in steps.inputs}
    log.info("captured %d base graphs (buckets %s) in %.1f s, %.2f GiB of device memory", steps.graphs.num_captures,
             buckets, steps.graphs.capture_seconds, used / (1 << 30))


def configure_blas(device: torch.device, name: str) -> str | None:
    """Choose the CUDA matmul library `name` (EngineConfig.blas_library; a process-wide PyTorch setting) before any
    graph is captured: a captured graph keeps the kernels chosen at capture. None off CUDA. cuBLASLt is the default:
    on an H200 at the 7B shape it runs the down projection of a 64-token decode step in 25.9 us a layer where cuBLAS
    picks a split-K kernel taking 30.1, and equals it on the other projections (docs/benchmarks-engine.md, "Batch 1
    and the matmul library")."""
    if device.type != "cuda":
        return None
    torch.backends.cuda.preferred_blas_library(name)
    log.info("CUDA matmuls through %s", name)
    return name


def uses_async_scheduling(config: EngineConfig) -> bool:
    """Steps overlap (the next is launched before this one's ids are read): by default on CUDA only, where the
    device runs ahead of the host; on CPU the forward runs on the host thread itself."""
    if config.async_scheduling is not None:
        return config.async_scheduling
    return config.device.startswith("cuda")
