"""Registers, spills and shared memory of the LoRA kernels compiled offline for sm_90 (no GPU needed).

`python -P -m kubelora.bench.resources`: compiles each launch shape with Triton's bundled ptxas and reads
`cuobjdump -res-usage` (the bundled cuobjdump). For checking a variant before spending device time.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kubelora.kernels.lora_expand import _expand_kernel
from kubelora.kernels.lora_shrink import _gemv_shrink_kernel, _shrink_kernel

POINTERS = {"tiles_ptr": "*i64", "rank_ptr": "*i64", "row_ptr": "*i64", "scale_ptr": "*fp32", "tcol_ptr": "*i64",
            "t_ptr": "*fp32", "parts_ptr": "*fp32", "arrivals_ptr": "*i32"}
# Arguments the launcher sees as multiples of 16 at the benchmark's sizes (Triton specializes on that).
DIVISIBLE = {"in_dim", "x_stride", "y_stride", "width0", "width1", "width2", "y_off0", "y_off1", "y_off2", "lanes",
             "k_per_split", "num_groups"}
COMMON = dict(NUM_S=3, SLOT_TILES=True, PRECISION="tf32", SPLIT=1, GROUPS=1, STACK=1, EARLY=False,
              RED_Y=False, T_IN_Y=False)
EXPAND = dict(BLOCK_M=16, BLOCK_R=16, USE_PDL=True)  # the decode expand
GEMV = dict(BLOCK_M=16, BLOCK_K=4096, USE_PDL=True)  # the GEMV shrink's shapes below, at in_dim 4096 in one step
SHAPES = [
    ("shrink m16 k128 split8", _shrink_kernel, dict(BLOCK_M=16, BLOCK_K=128, BLOCK_R=16, SPLIT=8, USE_PDL=False), 4, 3),
    ("shrink m16 pdl", _shrink_kernel, dict(BLOCK_M=16, BLOCK_K=128, BLOCK_R=16, SPLIT=8, USE_PDL=True), 4, 3),
    ("shrink m16 k128 split8 per-slice", _shrink_kernel, dict(BLOCK_M=16, BLOCK_K=128, BLOCK_R=16, SPLIT=8,
                                                              USE_PDL=True, GROUPS=3), 4, 3),
    ("gemv rows 2 ranks 4", _gemv_shrink_kernel, dict(GEMV, ROWS=2, RANKS=4), 8, 1),
    ("gemv rows 2 ranks 1", _gemv_shrink_kernel, dict(GEMV, ROWS=2, RANKS=1), 8, 1),
    ("gemv rows 8 ranks 4 k1024", _gemv_shrink_kernel, dict(GEMV, ROWS=8, RANKS=4, BLOCK_K=1024), 8, 1),
    ("gemv rows 4 ranks 4 k2048", _gemv_shrink_kernel, dict(GEMV, ROWS=4, RANKS=4, BLOCK_K=2048), 8, 1),
    ("expand m16 n256 pdl b4", _expand_kernel, dict(BLOCK_M=16, BLOCK_N=256, BLOCK_R=16, B_FIRST=4, USE_PDL=True), 8,
     2),
    ("expand m16 n256", _expand_kernel, dict(BLOCK_M=16, BLOCK_N=256, BLOCK_R=16, B_FIRST=0, USE_PDL=False), 8, 2),
    ("expand m16 n256 pdl", _expand_kernel, dict(BLOCK_M=16, BLOCK_N=256, BLOCK_R=16, B_FIRST=1, USE_PDL=True), 8,
     2),
    ("expand m32 n128 pdl", _expand_kernel, dict(BLOCK_M=32, BLOCK_N=128, BLOCK_R=16, B_FIRST=1, USE_PDL=True), 8,
     2),
    ("expand m64 n256", _expand_kernel, dict(BLOCK_M=64, BLOCK_N=256, BLOCK_R=16, B_FIRST=0, USE_PDL=False), 4, 2),
    # stacked column sub-blocks (2 tokens per tile: 8 sub-blocks; 8 tokens: 2), B requested for rank 16 / 64
    ("expand stack8 n256 b1", _expand_kernel, dict(EXPAND, BLOCK_N=256, B_FIRST=1, STACK=8), 8, 1),
    ("expand stack8 n256 b1 w4", _expand_kernel, dict(EXPAND, BLOCK_N=256, B_FIRST=1, STACK=8), 4, 1),
    ("expand stack8 n512 b1", _expand_kernel, dict(EXPAND, BLOCK_N=512, B_FIRST=1, STACK=8), 8, 1),
    ("expand stack8 n1024 b1", _expand_kernel, dict(EXPAND, BLOCK_N=1024, B_FIRST=1, STACK=8), 8, 1),
    ("expand stack8 n256 b4", _expand_kernel, dict(EXPAND, BLOCK_N=256, B_FIRST=4, STACK=8), 8, 1),
    ("expand stack8 n512 b4", _expand_kernel, dict(EXPAND, BLOCK_N=512, B_FIRST=4, STACK=8), 8, 1),
    ("expand stack2 n256 b1", _expand_kernel, dict(EXPAND, BLOCK_N=256, B_FIRST=1, STACK=2), 8, 1),
    ("expand stack2 n512 b1", _expand_kernel, dict(EXPAND, BLOCK_N=512, B_FIRST=1, STACK=2), 8, 1),
    ("expand m16 n256 b1 s1", _expand_kernel, dict(EXPAND, BLOCK_N=256, B_FIRST=1), 8, 1),
    # launched early behind the kernel before (KernelConfig.is_early_shrink)
    ("shrink per-slice early", _shrink_kernel, dict(BLOCK_M=16, BLOCK_K=256, BLOCK_R=16, SPLIT=8, USE_PDL=True,
                                                    GROUPS=3, EARLY=True), 4, 3),
    ("gemv rows 2 ranks 4 early", _gemv_shrink_kernel, dict(GEMV, ROWS=2, RANKS=4, EARLY=True), 8, 1),
    # 32 or 64 rank lanes per shrink program (KernelConfig.shrink_lanes)
    ("shrink r64 split4 early", _shrink_kernel, dict(BLOCK_M=16, BLOCK_K=128, BLOCK_R=64, SPLIT=4, USE_PDL=True,
                                                     EARLY=True), 4, 3),
    ("shrink per-slice r64 split8 early", _shrink_kernel, dict(BLOCK_M=16, BLOCK_K=128, BLOCK_R=64, SPLIT=8,
                                                               USE_PDL=True, GROUPS=3, EARLY=True), 4, 3),
    ("shrink per-slice r32 split8 early", _shrink_kernel, dict(BLOCK_M=16, BLOCK_K=128, BLOCK_R=32, SPLIT=8,
                                                               USE_PDL=True, GROUPS=3, EARLY=True), 4, 3),
    # the delta added into y by atomic adds (KernelConfig.is_red_y)
    ("expand stack2 n512 b1 red", _expand_kernel, dict(EXPAND, BLOCK_N=512, B_FIRST=1, STACK=2, RED_Y=True), 8, 1),
    ("expand stack2 n512 b1 red w4", _expand_kernel, dict(EXPAND, BLOCK_N=512, B_FIRST=1, STACK=2, RED_Y=True), 4,
     1),
    ("expand stack8 n512 b1 red", _expand_kernel, dict(EXPAND, BLOCK_N=512, B_FIRST=1, STACK=8, RED_Y=True), 8, 1),
    ("expand m16 n256 pdl b4 red", _expand_kernel, dict(BLOCK_M=16, BLOCK_N=256, BLOCK_R=16, B_FIRST=4, USE_PDL=True,
                                                        RED_Y=True), 8, 2),
]


def compile_sm90(fn, constexprs: dict, num_warps: int, num_stages: int):
    constexprs = {k: v for k, v in {**COMMON, **constexprs}.items() if k in fn.arg_names}
    signature = {name: "constexpr" if name in constexprs else POINTERS.get(name, "*bf16") if name.endswith("_ptr")
                 else "i32" for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if name not in constexprs and (name.endswith("_ptr") or name in DIVISIBLE)}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def res_usage(cubin: bytes) -> str:
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return " ".join(re.findall(r"(REG:\d+|STACK:\d+|SHARED:\d+|LOCAL:\d+)", out))


def main() -> None:
    for label, fn, constexprs, warps, stages in SHAPES:
        kernel = compile_sm90(fn, constexprs, warps, stages)
        usage = res_usage(kernel.asm["cubin"])
        print(f"{label:34s} warps {warps} stages {stages}: {usage} dynamic smem {kernel.metadata.shared}", flush=True)


if __name__ == "__main__":
    main()
