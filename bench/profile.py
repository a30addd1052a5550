"""One benchmark shape's LoRA launch, for Nsight Compute: `ncu --nvtx --nvtx-include "lora/" ... profile.py SHAPE PATH`.

SHAPE is a `kubelora bench kernels` shape name (e.g. "64 x 32 x 16"); PATH is `auto` (the step's own launch), a
`LoRAPath` value, or one followed by `-slice` (one shrink program per slice). Three warm-up calls, then two calls
inside the NVTX range `lora` on other input sets.
"""

from __future__ import annotations

import sys

import torch

from kubelora.kernels.bench_lora import default_shapes, ours, shape_sets
from kubelora.kernels.lora_config import LoRAPath, forced_plan


def main(name: str, path: str) -> None:
    shape = next(s for s in default_shapes() if s.name == name)
    _, sets = shape_sets(shape, torch.bfloat16)
    is_per_slice = path.endswith("-slice")
    path = path.removesuffix("-slice")
    plan = None if path == "auto" else forced_plan(sets[0].step, LoRAPath(path), is_per_slice=is_per_slice)
    for st in sets[:3]:
        ours(plan)(st)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("lora")
    for st in sets[3:5]:
        ours(plan)(st)
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "auto")
