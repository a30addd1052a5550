"""What the engine benchmark measures of the device itself: copy bandwidth, the bf16 matmul rate, versions.

Also the bytes floor of a decode step (what one step must read at least, over the measured copy bandwidth)
and the per-kernel split of a torch.profiler trace.
"""

from __future__ import annotations

import datetime
import gc
import platform
import subprocess
import time
from dataclasses import dataclass

import torch

from kubelora.bench.engine_assets import ATTENTION, MLP, ModelShape

COPY_BYTES = 2 << 30  # device-to-device copy size: many times the H200's 60 MB L2
NUM_TIMED = 10


def is_cuda(device: str) -> bool:
    return device.startswith("cuda")


def sync(device: str) -> None:
    if is_cuda(device):
        torch.cuda.synchronize()


def free_device(device: str) -> None:
    """Drop what the last engine left behind (call after its last reference is gone)."""
    gc.collect()
    if is_cuda(device):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def device_bytes_in_use(device: str) -> int:
    return torch.cuda.memory_allocated() if is_cuda(device) else 0


def environment(device: str) -> dict[str, str]:
    import transformers
    import triton

    env = {"device": torch.cuda.get_device_name() if is_cuda(device) else f"cpu ({platform.processor() or 'host'})",
           "driver": _driver() if is_cuda(device) else "-",
           "torch": torch.__version__, "cuda": str(torch.version.cuda), "triton": triton.__version__,
           "transformers": transformers.__version__, "python": platform.python_version(),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    return env


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def _timed(fn, device: str, repeats: int = NUM_TIMED) -> float:
    """Mean seconds of fn() over `repeats` calls after three warm-ups."""
    for _ in range(3):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    return (time.perf_counter() - start) / repeats


def copy_bandwidth(device: str, num_bytes: int = COPY_BYTES) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    seconds = _timed(lambda: dst.copy_(src), device)
    del src, dst
    free_device(device)
    return 2 * num_bytes / seconds


def matmul_flops(device: str, size: int) -> float:
    """FLOP/s of one size^3 matmul (bf16 on CUDA, float32 on the CPU), random inputs."""
    dtype = torch.bfloat16 if is_cuda(device) else torch.float32
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    seconds = _timed(lambda: a @ b, device)
    del a, b
    free_device(device)
    return 2 * size**3 / seconds


# ---- the bytes floor of a decode step ----

def weight_bytes(shape: ModelShape) -> int:
    """bf16 bytes a decode step reads of the base model: the checkpoint but the embedding table, which is only
    indexed (one row per sequence), unless it is tied: then it is the lm_head, read whole."""
    embedding = 0 if shape.is_tied else 2 * shape.vocab_size * shape.hidden_size
    return shape.checkpoint_bytes() - embedding


def window_context(prompt_len: int, output_len: int, window: int | None) -> float:
    """Mean tokens of KV a decode step reads in one layer, over contexts from prompt_len to prompt_len + output_len:
    all of them on a full-attention layer, at most `window` on a sliding one."""
    start, end = prompt_len, prompt_len + output_len
    if window is None or window >= end:
        return (start + end) / 2
    if window <= start:
        return float(window)
    return ((window**2 - start**2) / 2 + (end - window) * window) / output_len


def kv_bytes(shape: ModelShape, batch: int, prompt_len: int, output_len: int) -> float:
    """bf16 K and V bytes a decode step reads for `batch` sequences, on average over the decode: each layer's
    tokens inside its window."""
    per_token = 2 * 2 * shape.num_kv_heads * shape.head_dim
    return per_token * batch * sum(window_context(prompt_len, output_len, w) for w in shape.layer_windows())


@dataclass(frozen=True)
class Floor:
    batch: int
    num_adapters: int
    step_bytes: float
    copy_bytes_per_s: float

    @property
    def ms(self) -> float:
        return 1e3 * self.step_bytes / self.copy_bytes_per_s


def decode_floor(shape: ModelShape, batch: int, prompt_len: int, output_len: int, adapter_bytes: float,
                 num_adapters: int, copy_bytes_per_s: float) -> Floor:
    step_bytes = weight_bytes(shape) + kv_bytes(shape, batch, prompt_len, output_len) + adapter_bytes
    return Floor(batch, num_adapters, step_bytes, copy_bytes_per_s)


def prefill_flops(shape: ModelShape, num_prompts: int, prompt_len: int) -> float:
    """Model FLOPs of prefilling the prompts: 2 x linear weights x tokens, causal attention (QK^T and PV over
    half the square), lm_head on each prompt's last token only."""
    linear = sum(i * o for i, o in map(shape.module_dims, ATTENTION + MLP)) * shape.num_layers
    tokens = num_prompts * prompt_len
    attention = 2 * shape.num_layers * shape.num_heads * shape.head_dim * prompt_len**2 * num_prompts
    return 2 * linear * tokens + attention + 2 * shape.vocab_size * shape.hidden_size * num_prompts


# ---- torch.profiler split ----

def kernel_split(profiler, wall_s: float, num_steps: int, top: int = 12) -> dict:
    """GPU-busy share (union of kernel intervals / wall time) and the kernels taking most device time."""
    from torch.autograd import DeviceType

    kernels = [e for e in profiler.events() if e.device_type == DeviceType.CUDA and e.device_time > 0]
    intervals = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy_us, end = 0.0, float("-inf")
    for start, stop in intervals:
        busy_us += max(0.0, stop - max(start, end))
        end = max(end, stop)
    totals: dict[str, list[float]] = {}
    for e in kernels:
        entry = totals.setdefault(e.name, [0.0, 0])
        entry[0] += e.device_time
        entry[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
    kernel_us = sum(t for t, _ in totals.values())
    return {"num_steps": num_steps, "wall_ms_per_step": 1e3 * wall_s / max(num_steps, 1),
            "busy_ms_per_step": busy_us / 1e3 / max(num_steps, 1),
            "gpu_busy_share": busy_us / 1e6 / wall_s if wall_s > 0 else 0.0,
            "kernel_ms_per_step": kernel_us / 1e3 / max(num_steps, 1),
            "kernels": [{"name": name, "ms_per_step": t / 1e3 / max(num_steps, 1), "launches_per_step": n / max(num_steps, 1),
                         "share": t / kernel_us if kernel_us else 0.0} for name, (t, n) in ranked[:top]]}
