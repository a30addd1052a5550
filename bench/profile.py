"""One benchmark shape's LoRA launch, for Nsight Compute (bench/ncu.sh runs it under `ncu --nvtx`).

`ncu --nvtx --nvtx-include "lora/" ... python3 -P bench/profile.py SHAPE LAUNCH`.

SHAPE is a `kubelora bench kernels` shape name (e.g. "64 x 32 x 16"); LAUNCH is `auto` (the step's own launch),
`split` (the tile height's default config) or `slice` (the same with one shrink program per slice). Three warm-up
calls, then two calls inside the NVTX range `lora` on other input sets.
"""

from __future__ import annotations

import sys

import torch

from kubelora.kernels.bench_lora import default_shapes, ours, shape_sets
from kubelora.kernels.lora_config import step_config


def main(name: str, launch: str) -> None:
    shape = next(s for s in default_shapes() if s.name == name)
    _, sets = shape_sets(shape, torch.bfloat16)
    config = None if launch == "auto" else step_config(sets[0].step, is_per_slice=launch == "slice")
    for st in sets[:3]:
        ours(config)(st)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("lora")
    for st in sets[3:5]:
        ours(config)(st)
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "auto")
