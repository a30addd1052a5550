"""Kernel test fixtures. Without CUDA the Triton kernels run under Triton's CPU interpreter.

Triton picks the interpreter when a kernel is defined, i.e. when `kubelora.kernels.lora_shrink` and friends
are imported; TRITON_INTERPRET=1 is set here before any test imports them, and `triton_backend` re-imports
them if another test module of the same process got there first without it. The shared problem builders
(`lora_problems.py`) are imported from this folder, which --import-mode=importlib leaves off sys.path.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def triton_backend():
    """The Triton LoRA modules, built for the interpreter when there is no GPU."""
    from kubelora.kernels import lora_rotary, lora_triton  # noqa: F401 (reloaded below)

    if not HAS_CUDA and not lora_triton.is_interpreted():
        for name in ("lora_shrink", "lora_expand", "lora_triton", "lora_rotary"):
            importlib.reload(sys.modules[f"kubelora.kernels.{name}"])
    return sys.modules["kubelora.kernels.lora_triton"]
