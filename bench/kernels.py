"""`kubelora bench kernels`: time the Triton LoRA op against PyTorch baselines and the bytes floor.

Every call is captured in a CUDA graph over several independent input sets (rotated past the L2), so a
time is GPU time per call, launch gaps included but no Python. The floor is the bytes the op must move
(the distinct adapters' weights at their own ranks, x, y read and written) over the device-to-device
copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import math
import random
import statistics
from dataclasses import dataclass

import torch

from kubelora.bench.baselines import BenchSet, build_sets, gather_bmm, per_adapter_loop, torch_reference
from kubelora.bench.report import Row, format_table, write_markdown
from kubelora.kernels.lora import prepare_lora_step
from kubelora.kernels.lora_config import KernelConfig

L2_BYTES = 60 * 2**20
DEVICE = "cuda"  # the CPU smoke test of the bench code sets "cpu" (Triton's interpreter)
HIDDEN = 4096
WIDTHS = [4096, 4096, 4096]  # q, k, v


@dataclass(frozen=True)
class Shape:
    name: str
    slots: tuple[int, ...]
    ranks: tuple[int, ...]  # per adapter


def decode_shape(num_tokens: int, num_adapters: int, ranks: list[int], label: str = "") -> Shape:
    slots = [i % num_adapters for i in range(num_tokens)]
    random.Random(num_tokens * 131 + num_adapters).shuffle(slots)  # adapters interleaved
    rank_label = label or str(ranks[0])
    return Shape(f"{num_tokens} x {num_adapters} x {rank_label}", tuple(slots), tuple(ranks))


def default_shapes() -> list[Shape]:
    shapes = [decode_shape(t, a, [r] * a) for t in (1, 16, 64, 256) for a in (1, 8, 32) if a <= t
              for r in (8, 16, 64)]
    mixed = [8 + round(56 * i / 31) for i in range(32)]  # ranks 8..64, mean 36
    mean = round(sum(mixed) / len(mixed))
    for t in (64, 256):
        shapes.append(decode_shape(t, 32, random.Random(t).sample(mixed, 32), "8..64 mixed"))
        shapes.append(decode_shape(t, 32, [mean] * 32))
    prefill = [a for a in range(4) for _ in range(512)]
    shapes.append(Shape("prefill 4 x 512, 4 x 16", tuple(prefill), (16,) * 4))
    return shapes


def floor_bytes(shape: Shape, in_dim: int, widths: list[int], elem: int) -> int:
    weights = sum(r * (in_dim + d) for r in shape.ranks for d in widths)  # each slice has its own A and B
    return elem * (weights + len(shape.slots) * (in_dim + 2 * sum(widths)))


def copy_bandwidth(num_bytes: int = 2**31) -> float:
    """Device-to-device copy, bytes read plus bytes written per second, median of 20."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(23):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        dst.copy_(src)
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3)
    return 2 * num_bytes / statistics.median(times[3:])


def time_graph(fn, sets: list[BenchSet], trials: int = 7, min_ms: float = 10.0) -> float:
    """Microseconds per call: one CUDA graph calls fn once per set; median over trials of many replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for st in sets:
            fn(st)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for st in sets:
            fn(st)
    graph.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    graph.replay()
    e1.record()
    torch.cuda.synchronize()
    reps = max(1, math.ceil(min_ms / max(e0.elapsed_time(e1), 1e-3)))
    times = []
    for _ in range(trials):
        e0.record()
        for _ in range(reps):
            graph.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / (reps * len(sets)))
    return statistics.median(times)


def ours(config: KernelConfig | None = None):
    """Our op on a set; config None: the launch the step chooses (add_lora's)."""
    from kubelora.kernels.lora_triton import add_lora_triton

    return lambda st: add_lora_triton(st.y, st.x, st.lora_a, st.lora_b, st.proj, st.step, config)


def check_ours(sets: list[BenchSet], config: KernelConfig | None = None) -> float:
    """Relative error of our delta against the reference's, on set 0 (fresh copies of y)."""
    st = sets[0]
    y0 = st.y.clone()
    ours(config)(st)
    delta = st.y.float() - y0.float()
    st.y.copy_(y0)
    torch_reference(st)
    ref = st.y.float() - y0.float()
    st.y.copy_(y0)
    return float((delta - ref).norm() / ref.norm())


def shape_sets(shape: Shape, dtype: torch.dtype) -> tuple[int, list[BenchSet]]:
    """(floor bytes, enough independent input sets that one replay of them all streams past the L2)."""
    nbytes = floor_bytes(shape, HIDDEN, WIDTHS, torch.finfo(dtype).bits // 8)
    num_sets = max(2, min(256, math.ceil(3 * L2_BYTES / nbytes)))
    step = prepare_lora_step(list(shape.slots), len(shape.ranks), DEVICE)
    return nbytes, build_sets(list(shape.slots), list(shape.ranks), WIDTHS, HIDDEN, num_sets, step, dtype,
                              device=DEVICE)


def bench_shape(shape: Shape, bandwidth: float, dtype: torch.dtype, with_baselines: bool) -> Row:
    nbytes, sets = shape_sets(shape, dtype)
    step = sets[0].step
    row = Row(shape.name, nbytes, nbytes / bandwidth * 1e6, error=check_ours(sets), block_m=step.block_m)
    row.times["ours"] = time_graph(ours(), sets)
    if with_baselines:
        for name, fn in (("gather+bmm", gather_bmm), ("loop", per_adapter_loop), ("torch ref", torch_reference)):
            try:
                row.times[name] = time_graph(fn, sets)
            except RuntimeError as err:  # e.g. a baseline that cannot be captured in a graph
                print(f"  {shape.name}: {name} failed: {str(err).splitlines()[0]}")
    del sets
    torch.cuda.empty_cache()
    return row


def variations(args: argparse.Namespace, shapes: list[Shape], dtype: torch.dtype) -> list[str]:
    """--tune and --compare lines (config and launch variants timed side by side)."""
    from kubelora.bench.variants import compare_paths, tune

    lines = tune([s for s in shapes if s.name in args.tune], dtype) if args.tune else []
    if args.compare is not None:
        names = args.compare or [s.name for s in shapes if not s.name.startswith("prefill")]
        lines += compare_paths([s for s in shapes if s.name in names], dtype, args.pdl, args.variants)
    return lines


def run(args: argparse.Namespace) -> int:
    import triton

    dtype = torch.bfloat16
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    shapes = default_shapes()
    rows = []
    for shape in shapes:
        if args.shapes and shape.name not in args.shapes:
            continue
        rows.append(bench_shape(shape, bandwidth, dtype, not args.no_baselines))
        print(format_table(rows[-1:], header=not rows[:-1]), flush=True)
    env = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "cuda": torch.version.cuda, "copy bandwidth": f"{bandwidth / 1e9:.0f} GB/s",
        "date": args.date or datetime.date.today().isoformat(),
    }
    table = format_table(rows)
    print("\n" + "\n".join(f"{k}: {v}" for k, v in env.items()))
    print(table, flush=True)
    if args.write:  # written before the variations, so that a run cut short still leaves the table
        write_markdown(args.write, env, table, rows, [])
    variation_lines = variations(args, shapes, dtype)
    if args.write and variation_lines:
        write_markdown(args.write, env, table, rows, variation_lines)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--write", default=None, help="write the results as markdown to this path")
    parser.add_argument("--date", default=None, help="date written into the report (default: today)")
    parser.add_argument("--no-baselines", action="store_true", help="time only the Triton op")
    parser.add_argument("--tune", nargs="*", default=[], help="shape names whose config variations to time")
    parser.add_argument("--compare", nargs="*", default=None,
                        help="shape names to time each launch variant on (none given: every decode shape)")
    parser.add_argument("--pdl", action="store_true", help="with --compare: time the PDL variant too")
    parser.add_argument("--variants", nargs="*", default=None,
                        help="with --compare: only the variants with these labels (default: all)")
    parser.add_argument("--shapes", nargs="*", default=[], help="bench only these shape names (default: all)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kubelora bench kernels", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
