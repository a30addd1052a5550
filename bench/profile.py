"""One benchmark shape's LoRA launch, for Nsight Compute (bench/ncu.sh runs it under `ncu --nvtx`).

`ncu --nvtx --nvtx-include "lora/" ... python3 -P -m kubelora.bench.profile SHAPE LAUNCH`.

SHAPE is a `kubelora bench kernels` shape name (e.g. "64 x 32 x 16"); LAUNCH is a label of
`kubelora.bench.variants.PATH_VARIANTS` (`auto`: the step's own launch). Three warm-up calls, then two calls
inside the NVTX range `lora` on other input sets.
"""

from __future__ import annotations

import sys

import torch

from kubelora.bench.kernels import default_shapes, ours, shape_sets
from kubelora.bench.variants import PATH_VARIANTS


def main(name: str, launch: str) -> None:
    shape = next(s for s in default_shapes() if s.name == name)
    _, sets = shape_sets(shape, torch.bfloat16)
    step_changes, config_for = PATH_VARIANTS[launch]
    assert not step_changes, "variants with their own step are not profiled"
    config = None if config_for is None else config_for(sets[0].step, sets[0].proj)
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
