"""Hopper programmatic dependent launch (PDL) for the decoder's own Triton launches.

A launch made with `launch_pdl` may start while the launch before it on the stream is still running, once that
one's programs have all called `gdc_launch_dependents` (or exited); `gdc_wait` then blocks until the launch
before has finished and its writes are visible. The base path's launches (the single-row GEMVs, residual add +
RMSNorm, SiLU x mul, rotary with the KV-cache write, decode attention) each call `gdc_wait` before touching
anything the launch before may write, then `gdc_launch_dependents`, so the next launch's programs are
dispatched while this one runs and the launch gap between them is hidden. Calling the trigger only after the
wait keeps every launch two back finished by the time a launch starts, so reads of data no launch writes
(weights: the GEMV's first chunk) are the only ones allowed before the wait.

Used for one-token steps only: there a decode step is a chain of short weight-streaming launches whose gaps are a
visible share of the step (an H200 at the 7B shape: 3.96 -> 3.83 ms a step at batch 1), while between cuBLAS
matmuls, which do not wait on their launch before, the same launches measured slower (batch 64: 5.95 -> 6.00 ms).
On by default where griddepcontrol exists (compute capability >= 9, a Triton build that has it, not the CPU
interpreter); `KUBELORA_PDL=0` turns it off (launches as plain stream-ordered kernels).
"""

from __future__ import annotations

import functools
import os

import torch
import triton

PDL_ENV = "KUBELORA_PDL"

try:  # absent from older Triton builds
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_PDL = True
except ImportError:  # pragma: no cover
    HAS_PDL = False

    @triton.jit
    def gdc_launch_dependents():
        pass

    @triton.jit
    def gdc_wait():
        pass


@functools.cache
def _has_griddepcontrol(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def uses_pdl(is_pdl: bool, device: torch.device) -> bool:
    """is_pdl where it can run: a CUDA device of compute capability >= 9 (not the CPU interpreter)."""
    return is_pdl and HAS_PDL and _has_griddepcontrol(device)


def is_base_pdl_enabled() -> bool:
    return os.environ.get(PDL_ENV, "1") != "0"


def base_launch(device: torch.device, num_rows: int = 1) -> dict:
    """Keyword arguments of one base-path launch over num_rows tokens (sequences, for decode attention): USE_PDL
    (the kernel's constexpr) and, with it, launch_pdl. Programmatic for one row only (see the module docstring)."""
    if num_rows == 1 and uses_pdl(is_base_pdl_enabled(), device):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}
