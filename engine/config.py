"""Engine configuration: one frozen dataclass, validated on construction (the server builds it from flags)."""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("auto", "float32", "bfloat16", "float16")
BLAS_LIBRARIES = ("cublaslt", "cublas")
DEFAULT_CPU_LORAS = 4  # the CPU pool's default size, in adapters of max_lora_rank, when max_loras is not set


@dataclass(frozen=True)
class EngineConfig:
    """Limits and sizes of one engine. `None` means "derive from the model and device" (see docs).

    - max_loras: distinct adapters in one batch; None (default): as many as the device adapter pool holds at
      their own ranks (the byte budget is the limit). max_lora_rank: the largest rank accepted.
    - max_cpu_loras: host-tier LRU capacity (adapters with requests in flight are never evicted).
    - max_lora_pool_bytes: device adapter pool budget, counted in rank rows of every target module (q, k, v, o,
      gate, up, down). Default: with max_loras set, max_loras * max_lora_rank rows; else on CUDA
      lora_pool_fraction of the device memory free after the weights are loaded (the KV cache then takes
      gpu_memory_utilization of what is left), on CPU DEFAULT_CPU_LORAS * max_lora_rank rows. Adapters take
      bytes at their own rank, so lower-rank adapters fit more.
    - max_model_len: prompt + output tokens per request; default the model's max_position_embeddings.
    - KV cache: num_kv_blocks blocks of kv_block_size tokens; default from kv_cache_bytes, else (CPU) room for
      max_num_seqs full-length sequences, else (CUDA) gpu_memory_utilization of what weights and pool leave.
    - lora_backend: "torch" or "triton"; default kubelora.kernels.lora.default_backend(device).
    - lora_time_slice_steps: while requests wait for room in the device adapter pool, the steps an adapter keeps
      its room before its requests pause (KV cache kept) so waiting adapters take turns (engine/scheduler.py).
    - enforce_eager: run every step eagerly from its own tensors (no static layouts, no CUDA graphs; vLLM's name).
      Otherwise decode steps and short prefill chunks run from static layouts: CUDA graphs on CUDA, the same
      inputs eagerly elsewhere.
    - use_gemv: one-token steps on CUDA run their projections as the Triton GEMV (kernels/gemv.py); False: cuBLAS.
    - use_prefill_graphs: a lone sequence's short prefill chunk replays a CUDA graph (engine/step/executor.py).
    - use_staged_shrink: LoRA decode steps on the static path with the Triton backend compute their shrink in the
      base matmul (engine/adapters/staging.py).
    - blas_library: the library PyTorch's CUDA matmuls use, "cublaslt" or "cublas" (engine/setup.py: configure_blas).
    - async_scheduling: schedule the next step and queue its forward pass before reading this one's sampled ids
      back, so host work overlaps the device (vLLM's name); None (default): on CUDA, off on CPU.
    - enable_prefix_caching: full KV blocks stay cached, keyed by their tokens, every token before them, the adapter's
      name and content revision and the request's cache_salt, and later requests with the same prefix reuse them
      (vLLM's name; engine/block_manager.py).
    - is_base_model_strict: reject (True) or warn about (False) an adapter whose base_model_name_or_path
      differs from the served model; shapes are always checked.
    """

    model_dir: str
    device: str = "cpu"
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    max_loras: int | None = None
    max_lora_rank: int = 16
    max_cpu_loras: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_waiting: int = 1024
    kv_block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.85
    lora_pool_fraction: float = 0.05
    lora_time_slice_steps: int = 16
    max_lora_pool_bytes: int | None = None
    lora_backend: str | None = None
    is_base_model_strict: bool = False
    enforce_eager: bool = False
    use_gemv: bool = True
    use_prefill_graphs: bool = True
    use_staged_shrink: bool = True
    blas_library: str = BLAS_LIBRARIES[0]
    async_scheduling: bool | None = None
    enable_prefix_caching: bool = True
    num_loader_threads: int = 2
    served_model_name: str | None = None
    seed: int = 0  # seeds the global generator used by unseeded sampling requests

    def __post_init__(self) -> None:
        if not self.model_dir:
            raise ValueError("model_dir must be a model directory, got an empty value")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.max_loras is not None:
            _check_range("max_loras", self.max_loras, 1, 4096)
        _check_range("max_lora_rank", self.max_lora_rank, 1, 4096)
        _check_range("max_cpu_loras", self.max_cpu_loras, 1, 1 << 20)
        _check_range("max_num_seqs", self.max_num_seqs, 1, 1 << 16)
        _check_range("max_num_batched_tokens", self.max_num_batched_tokens, 1, 1 << 24)
        _check_range("max_waiting", self.max_waiting, 1, 1 << 24)
        _check_range("kv_block_size", self.kv_block_size, 1, 1024)
        _check_range("num_loader_threads", self.num_loader_threads, 1, 64)
        _check_range("lora_time_slice_steps", self.lora_time_slice_steps, 1, 1 << 20)
        for name in ("max_model_len", "num_kv_blocks", "kv_cache_bytes", "max_lora_pool_bytes"):
            if getattr(self, name) is not None:
                _check_range(name, getattr(self, name), 1, 1 << 48)
        if not 0.0 < self.lora_pool_fraction < 1.0:
            raise ValueError(f"lora_pool_fraction must be in (0, 1), got {self.lora_pool_fraction}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.blas_library not in BLAS_LIBRARIES:
            raise ValueError(f"blas_library must be one of {', '.join(BLAS_LIBRARIES)}, got {self.blas_library!r}")
        if self.lora_backend not in (None, "torch", "triton"):
            raise ValueError(f"lora_backend must be 'torch', 'triton' or None (auto), got {self.lora_backend!r}")


def _check_range(name: str, value: int, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
