"""Arrival counters for kernels whose programs split one reduction: each program writes its partial, adds one to
its output's counter, and the program that arrives last merges the partials and resets the counter to zero.

The counters are int32 device buffers, one per (device, user), zero between launches, allocated once and grown
when a launch needs more. A buffer grown during a CUDA-graph capture would belong to the graph's pool, so each
user's first (eager) launch of its largest shape must come before capturing it, as the engine's warm-up forward
passes do. One stream at a time may use a user's counters.
"""

from __future__ import annotations

import torch

_counters: dict[tuple[torch.device, str], torch.Tensor] = {}


def arrival_counters(device: torch.device, size: int, user: str) -> torch.Tensor:
    """At least `size` zeroed int32 counters of `user` (e.g. "lora_shrink", "decode_attention") on `device`."""
    counters = _counters.get((device, user))
    if counters is None or counters.numel() < size:
        counters = _counters[(device, user)] = torch.zeros(max(size, 4096), device=device, dtype=torch.int32)
    return counters
