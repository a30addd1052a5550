"""Offline probe (no GPU): a persistent decode expand written in Gluon, compiled for sm_90, its SASS counted.

For the question docs/kernels.md leaves open ("What the misses need"): how many instructions one work item of a
hand-scheduled expand costs. Each program loops over work items (B first row, rank, column block, t row, token
count; token ids beside), keeping STAGES - 1 items' B and y tiles in flight in shared memory, and for each item
multiplies t by B on the tensor cores and stores y: by cp.async gathers, or with `--tma` by the bulk copy engine
(one copy for the B tile and one per token row of y, 2 rows per item, completion on an mbarrier; y stored by
TMA). Not used by the engine and not tested: Gluon is experimental and its API changes between Triton releases.
It needs the device's Triton, 3.6 (`pip install --no-deps --target /tmp/t36 triton==3.6.0`, then
`PYTHONPATH=/tmp/t36 python -P bench/gluon_probe.py [--tma] [BLOCK_N] [STAGES]`); Triton 3.9 renamed
`async_copy_global_to_shared`. Prints registers, shared memory, and the SASS instructions of the whole kernel
and of its item loop.
"""
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma


@gluon.jit
def _issue(smem_b, smem_y, y_ptr, b_ptr, toks_ptr, items_ptr, item, width, y_stride, valid,
           BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_R: gl.constexpr, LOAD: gl.constexpr):
    # item row: (B first row, rank, column block, t first row, count)
    row = gl.load(items_ptr + item * 5)
    rank = gl.load(items_ptr + item * 5 + 1)
    nb = gl.load(items_ptr + item * 5 + 2)
    count = gl.load(items_ptr + item * 5 + 4)
    offs_r = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, LOAD))
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LOAD))
    offs_n = nb * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, LOAD))
    n_mask = offs_n < width
    b_ptrs = b_ptr + (row + offs_r)[:, None] * width + offs_n[None, :]
    async_copy.async_copy_global_to_shared(smem_b, b_ptrs, mask=((offs_r < rank) & valid)[:, None] & n_mask[None, :])
    tok = gl.load(toks_ptr + item * BLOCK_M + offs_m)
    y_ptrs = y_ptr + tok[:, None] * y_stride + offs_n[None, :]
    async_copy.async_copy_global_to_shared(smem_y, y_ptrs, mask=((offs_m < count) & valid)[:, None] & n_mask[None, :])


@gluon.jit
def expand_persistent(y_ptr, b_ptr, t_ptr, toks_ptr, items_ptr, num_items, width, y_stride, lanes,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_R: gl.constexpr, STAGES: gl.constexpr):
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    SMEM: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
    MMA: gl.constexpr = gl.NVMMADistributedLayout([2, 0], [1, 4], [16, 8])
    A_OP: gl.constexpr = gl.DotOperandLayout(0, MMA, 8)
    B_OP: gl.constexpr = gl.DotOperandLayout(1, MMA, 8)
    smem_b = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_R, BLOCK_N], SMEM)
    smem_y = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BLOCK_N], SMEM)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    for s in gl.static_range(STAGES - 1):
        item = pid + s * nprog
        _issue(smem_b.index(s), smem_y.index(s), y_ptr, b_ptr, toks_ptr, items_ptr, item % num_items, width,
               y_stride, item < num_items, BLOCK_M, BLOCK_N, BLOCK_R, LOAD)
        async_copy.commit_group()
    k = 0
    for item in range(pid, num_items, nprog):
        ahead = item + (STAGES - 1) * nprog
        stage_next = (k + STAGES - 1) % STAGES
        _issue(smem_b.index(stage_next), smem_y.index(stage_next), y_ptr, b_ptr, toks_ptr, items_ptr,
               ahead % num_items, width, y_stride, ahead < num_items, BLOCK_M, BLOCK_N, BLOCK_R, LOAD)
        async_copy.commit_group()
        async_copy.wait_group(STAGES - 1)
        stage = k % STAGES
        t_row = gl.load(items_ptr + item * 5 + 3)
        rank = gl.load(items_ptr + item * 5 + 1)
        nb = gl.load(items_ptr + item * 5 + 2)
        count = gl.load(items_ptr + item * 5 + 4)
        offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, A_OP))
        offs_k = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, A_OP))
        t = gl.load(t_ptr + (t_row + offs_m)[:, None] * lanes + offs_k[None, :],
                    mask=(offs_m < count)[:, None] & (offs_k < rank)[None, :], other=0.0)
        b = smem_b.index(stage).load(B_OP)
        acc = mma_v2(t.to(gl.bfloat16), b, gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA))
        y_old = smem_y.index(stage).load(MMA)
        offs_ym = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, MMA))
        offs_yn = nb * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))
        tok = gl.load(toks_ptr + item * BLOCK_M + offs_ym)
        gl.store(y_ptr + tok[:, None] * y_stride + offs_yn[None, :], (y_old.to(gl.float32) + acc).to(gl.bfloat16),
                 mask=(offs_ym < count)[:, None] & (offs_yn < width)[None, :])
        k += 1


@gluon.jit
def _issue_tma(b_desc, y_desc, smem_b, smem_y, bar, toks_ptr, items_ptr, item, valid, ROWS: gl.constexpr,
           BLOCK_N: gl.constexpr):
    row = gl.load(items_ptr + item * 5).to(gl.int32)
    nb = gl.load(items_ptr + item * 5 + 2).to(gl.int32)
    mbarrier.expect(bar, b_desc.block_type.nbytes + ROWS * y_desc.block_type.nbytes, pred=valid)
    tma.async_copy_global_to_shared(b_desc, [row, nb * BLOCK_N], bar, smem_b, pred=valid)
    for q in gl.static_range(ROWS):
        tok = gl.load(toks_ptr + item * 16 + q).to(gl.int32)  # past the count: a real token
        tma.async_copy_global_to_shared(y_desc, [tok, nb * BLOCK_N], bar, smem_y.slice(q, 1), pred=valid)


@gluon.jit
def expand_tma(b_desc, y_desc, t_ptr, toks_ptr, items_ptr, num_items, lanes,
               ROWS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_R: gl.constexpr, STAGES: gl.constexpr):
    MMA: gl.constexpr = gl.NVMMADistributedLayout([2, 0], [1, 4], [16, 8])
    A_OP: gl.constexpr = gl.DotOperandLayout(0, MMA, 8)
    B_OP: gl.constexpr = gl.DotOperandLayout(1, MMA, 8)
    smem_b = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_R, BLOCK_N], b_desc.layout)
    smem_y = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 16, BLOCK_N], y_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    for s in gl.static_range(STAGES - 1):
        item = pid + s * nprog
        _issue_tma(b_desc, y_desc, smem_b.index(s), smem_y.index(s), bars.index(s), toks_ptr, items_ptr,
               item % num_items, item < num_items, ROWS, BLOCK_N)
    k = 0
    for item in range(pid, num_items, nprog):
        ahead = item + (STAGES - 1) * nprog
        nxt = (k + STAGES - 1) % STAGES
        tma.store_wait(0)  # the stage about to be refilled was last stored from
        _issue_tma(b_desc, y_desc, smem_b.index(nxt), smem_y.index(nxt), bars.index(nxt), toks_ptr, items_ptr,
               ahead % num_items, ahead < num_items, ROWS, BLOCK_N)
        stage = k % STAGES
        mbarrier.wait(bars.index(stage), (k // STAGES) & 1)
        t_row = gl.load(items_ptr + item * 5 + 3)
        rank = gl.load(items_ptr + item * 5 + 1)
        nb = gl.load(items_ptr + item * 5 + 2).to(gl.int32)
        count = gl.load(items_ptr + item * 5 + 4)
        offs_m = gl.arange(0, 16, layout=gl.SliceLayout(1, A_OP))
        offs_k = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, A_OP))
        t = gl.load(t_ptr + (t_row + offs_m)[:, None] * lanes + offs_k[None, :],
                    mask=(offs_m < count)[:, None] & (offs_k < rank)[None, :], other=0.0)
        acc = mma_v2(t.to(gl.bfloat16), smem_b.index(stage).load(B_OP), gl.zeros([16, BLOCK_N], gl.float32, MMA))
        y_tile = smem_y.index(stage)
        y_tile.store((y_tile.load(MMA).to(gl.float32) + acc).to(gl.bfloat16))
        fence_async_shared()
        for q in gl.static_range(ROWS):
            tok = gl.load(toks_ptr + item * 16 + q).to(gl.int32)
            if q < count:
                tma.async_copy_shared_to_global(y_desc, [tok, nb * BLOCK_N], y_tile.slice(q, 1))
        k += 1
    tma.store_wait(0)


NO_SWIZZLE = ("NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2, transposed=False, "
              "fp4_padded=False, cga_layout=[])")


def compile_probe(use_tma: bool, block_n: int, stages: int, rows: int):
    """The probe kernel compiled for sm_90 (4 warps)."""
    if use_tma:
        fn, consts = expand_tma, dict(ROWS=rows, BLOCK_N=block_n, BLOCK_R=16, STAGES=stages)
        sig = {"b_desc": f"tensordesc<bf16[16, {block_n}],{NO_SWIZZLE}>",
               "y_desc": f"tensordesc<bf16[1, {block_n}],{NO_SWIZZLE}>", "t_ptr": "*fp32", "toks_ptr": "*i64",
               "items_ptr": "*i64", "num_items": "i32", "lanes": "i32"}
        attrs = {}
    else:
        fn, consts = expand_persistent, dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_R=16, STAGES=stages)
        sig = {n: ("*bf16" if n in ("y_ptr", "b_ptr") else "*fp32" if n == "t_ptr" else "*i64" if n.endswith("_ptr")
                   else "i32") for n in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if n.endswith("_ptr") or n in ("width", "y_stride", "lanes")}
    sig.update({k: "constexpr" for k in consts})
    src = GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--tma"]
    use_tma = "--tma" in sys.argv[1:]
    block_n, stages = (int(args[0]) if args else 256), (int(args[1]) if len(args) > 1 else 3)
    k = compile_probe(use_tma, block_n, stages, rows=2)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        res = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout
    print(" ".join(re.findall(r"(REG:\d+|SHARED:\d+|LOCAL:\d+)", res)), "dynamic smem", k.metadata.shared)
    print("SASS instructions:", len(re.findall(r"/\*([0-9a-f]{4})\*/", sass)))
    loops = [(int(s, 16), int(e, 16)) for e, s in re.findall(r"/\*([0-9a-f]{4})\*/\s+@!?P\d BRA 0x([0-9a-f]+)", sass)]
    start, end = max(((s, e) for s, e in loops if s < e), key=lambda se: se[1] - se[0])  # the item loop: the longest
    print("SASS instructions per work item (the loop body):", (end - start) // 16 + 1)

if __name__ == "__main__":
    main()
