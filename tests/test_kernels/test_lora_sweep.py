"""The full GPU sweep of the Triton LoRA op against float64: run on an H200 as its own command,

    python -P -m pytest tests/test_kernels/test_lora_sweep.py

fp16 and bf16; 1..4096 tokens; 1..64 adapters with ranks 1..128 mixed in one batch (some slices at rank 0);
one adapter, all distinct, uniform, Zipf-skewed and prefill segments; the step's own launch and each shrink
layout forced (one program per slice or all slices per program, with and without PDL); tokens without adapter; slices of
unequal widths and dimensions that are not multiples of the block sizes. Skipped without CUDA.
"""

from __future__ import annotations

import random

import pytest
import torch

from kubelora.kernels.lora import add_lora
from kubelora.kernels.lora_config import step_config
from lora_problems import DISTRIBUTIONS, build_problem, check_y

pytestmark = pytest.mark.gpu  # the full sweep: deselected without a GPU (tests/conftest.py)

# (slice widths, in_dim): q/k/v with and without GQA, gate/up, single projections, odd sizes.
SHAPES = [
    ([4096, 4096, 4096], 4096),
    ([4096, 1024, 1024], 4096),
    ([2048, 256, 256], 2048),
    ([1000, 136, 72], 1000),
    ([11008, 11008], 4096),
    ([4096], 11008),
    ([4100], 4100),
    ([3, 5, 1], 7),
]
TOKENS = [1, 2, 7, 16, 17, 63, 64, 100, 256, 511, 1024, 4096]


def sweep_cases(num_cases: int = 48) -> list[tuple]:
    rng = random.Random(0)
    cases = []
    for i in range(num_cases):
        widths, in_dim = SHAPES[i % len(SHAPES)]
        num_tokens = TOKENS[i % len(TOKENS)] if i < 36 else rng.randint(1, 4096)
        dist = DISTRIBUTIONS[i % len(DISTRIBUTIONS)]
        num_adapters = num_tokens if dist == "distinct" else rng.choice([1, 2, 5, 8, 32, 64])
        num_adapters = max(1, min(num_adapters, 64, num_tokens))
        max_rank = rng.choice([1, 8, 16, 64, 128])
        ranks = [[rng.choice([0, rng.randint(1, max_rank)]) if rng.random() < 0.15 else rng.randint(1, max_rank)
                  for _ in widths] for _ in range(num_adapters)]
        ranks[0] = [max(r, 1) for r in ranks[0]]
        cases.append((num_tokens, ranks, widths, in_dim, dist, rng.choice([0.0, 0.0, 0.3]), i))
    return cases


# The step's own launch (add_lora, PDL on decode steps), or the tile height's default config with these changes.
# Decode (16-row) tiles add into y by atomic adds by default: `red` covers taller tiles, `loaded-y` the other path.
LAUNCHES = {
    "auto": None, "split-no-pdl": {"is_pdl": False}, "split-not-early": {"is_early_shrink": False},
    "slice": {"is_per_slice": True}, "slice-no-pdl": {"is_per_slice": True, "is_pdl": False},
    "all-slices": {"is_per_slice": False}, "gemv": {"gemv_rows": 8},
    "gemv-r1-no-pdl": {"gemv_rows": 8, "gemv_ranks": 1, "is_pdl": False},
    "stack": {"stack_tokens": 8},
    "stack-n512-b1-no-pdl": {"stack_tokens": 8, "block_n": 512, "b_first": 1, "is_pdl": False},
    "gemv-stack": {"gemv_rows": 8, "stack_tokens": 8},
    "slice-r64": {"shrink_lanes": 64, "is_per_slice": True}, "r32-no-pdl": {"shrink_lanes": 32, "is_pdl": False},
    "red": {"is_red_y": True}, "loaded-y": {"is_red_y": False},
    "stack-loaded-y-no-pdl": {"stack_tokens": 8, "is_red_y": False, "is_pdl": False},
}


@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", sweep_cases(), ids=lambda c: f"{c[6]}-{c[0]}tok-{len(c[1])}ad-{c[4]}")
def test_sweep(dtype, case, launch):
    """Every case on the step's own launch (add_lora) and on each launch forced."""
    from kubelora.kernels.lora_triton import add_lora_triton

    num_tokens, ranks, widths, in_dim, dist, no_adapter, seed = case
    p = build_problem(num_tokens, ranks, widths, in_dim, dist, dtype, seed=seed, device="cuda", no_adapter=no_adapter)
    y = p.y0.clone()
    if LAUNCHES[launch] is None:
        add_lora(y, p.x, p.lora_a, p.lora_b, p.proj, p.step, backend="triton")
    else:
        add_lora_triton(y, p.x, p.lora_a, p.lora_b, p.proj, p.step, step_config(p.step, **LAUNCHES[launch]))
    torch.cuda.synchronize()
    check_y(p, y)
