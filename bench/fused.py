"""Fused small ops against torch: `python3 -P bench/fused.py [--out FILE] [--no-compile]` on a CUDA machine.

Each op of kubelora.kernels.fused (Triton), its plain-torch reference run eagerly, and torch.compile of that
reference (mode default), at 1, 64, 256 and 2048 tokens of the Llama-7B shape in bf16. Microseconds per call,
two ways: `stream` (calls launched back to back, so host launch cost shows where it exceeds the GPU time) and
`graph` (the same calls replayed from a CUDA graph: GPU time, what a captured decode step pays). GB/s: the bytes
the op must move over the graph time. `first s`: the first call at that size, sync included (Triton's compile,
torch.compile's compile or recompile). `max err`: against the eager reference on the same inputs, relative to
the output's largest element (bf16's ulp at 1 is 0.0078; torch.compile skips the reference's bf16 roundings).
--smoke: tiny shapes on CPU under the Triton interpreter, no compile, no graphs (checks that the script runs).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

LLAMA_7B = {"hidden": 4096, "inter": 11008, "num_heads": 32, "num_kv_heads": 32, "head_dim": 128}
SMOKE = {"hidden": 96, "inter": 200, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16}
STREAM_CALLS, GRAPH_CALLS, GRAPH_REPLAYS = 100, 20, 10


@dataclass(frozen=True)
class Problem:
    """One op at one size: its arguments, the bytes it must move, and its implementations by name."""

    op: str
    num_tokens: int
    args: tuple
    num_bytes: int
    impls: dict[str, Callable]


def op_table(fused) -> dict[str, tuple[Callable, Callable]]:
    """op -> (Triton op, its torch reference)."""
    return {"add_rms_norm": (fused.add_rms_norm, fused.add_rms_norm_torch),
            "silu_mul": (fused.silu_mul, fused.silu_mul_torch),
            "rotary_": (fused.rotary_, fused.rotary_torch_)}


def build_problems(ops: dict, shape: dict, num_tokens: int, compiled: dict, device: str) -> list[Problem]:
    hidden, inter, head_dim = shape["hidden"], shape["inter"], shape["head_dim"]
    num_heads, num_kv_heads = shape["num_heads"], shape["num_kv_heads"]
    dtype, size = torch.bfloat16, 2

    def randn(*dims):
        return torch.randn(*dims, device=device).to(dtype)

    norm_args = (randn(num_tokens, hidden), randn(num_tokens, hidden), randn(hidden), 1e-5)
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
    q, k, _ = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    positions = torch.randint(0, 4096, (num_tokens,), device=device)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    rotary_args = (q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim), positions,
                   inv_freq, 1.0)
    table = [("add_rms_norm", norm_args, (4 * num_tokens + 1) * hidden * size),
             ("silu_mul", (randn(num_tokens, 2 * inter),), 3 * num_tokens * inter * size),
             ("rotary_", rotary_args, 2 * num_tokens * (num_heads + num_kv_heads) * head_dim * size + 8 * num_tokens)]
    problems = []
    for op, args, num_bytes in table:
        impls = dict(zip(("triton", "torch"), ops[op]))
        if op in compiled:
            impls["compile"] = compiled[op]
        problems.append(Problem(op, num_tokens, args, num_bytes, impls))
    return problems


def outputs_on_copies(fn: Callable, args: tuple) -> list[torch.Tensor]:
    """fn's results on copies of args (the in-place rotary_: its rotated q and k)."""
    copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    result = fn(*copies)
    if result is None:
        return copies[:2]
    return list(result) if isinstance(result, tuple) else [result]


def max_error(problem: Problem, name: str) -> float:
    """max |impl - reference| over each output, relative to the output's largest |reference| element."""
    got = outputs_on_copies(problem.impls[name], problem.args)
    expected = outputs_on_copies(problem.impls["torch"], problem.args)
    return max(((g.float() - e.float()).abs().max() / e.float().abs().max()).item() for g, e in zip(got, expected))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def first_call_s(fn: Callable, args: tuple, device: str) -> float:
    start = time.perf_counter()
    fn(*args)
    sync(device)
    return time.perf_counter() - start


def stream_us(fn: Callable, args: tuple, device: str) -> float:
    calls = STREAM_CALLS if device == "cuda" else 2
    sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    sync(device)
    return (time.perf_counter() - start) * 1e6 / calls


def graph_us(fn: Callable, args: tuple) -> float:
    """Per call, GRAPH_CALLS calls captured in one graph and replayed GRAPH_REPLAYS times (after one replay)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn(*args)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(GRAPH_REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (GRAPH_REPLAYS * GRAPH_CALLS)


def measure(problem: Problem, name: str, device: str) -> list[str]:
    fn, args = problem.impls[name], problem.args
    first = first_call_s(fn, args, device)
    fn(*args)
    stream = stream_us(fn, args, device)
    graph = "-"
    if device == "cuda":
        try:
            graph = graph_us(fn, args)
        except RuntimeError as error:  # a capture that fails is reported, not fatal to the table
            print(f"# {problem.op} {problem.num_tokens} {name}: capture failed: {error}", file=sys.stderr)
    gbps = "-" if graph == "-" else f"{problem.num_bytes / graph / 1e3:.0f}"
    graph_text = graph if graph == "-" else f"{graph:.1f}"
    err = "0" if name == "torch" else f"{max_error(problem, name):.2g}"
    return [problem.op, str(problem.num_tokens), name, f"{stream:.1f}", graph_text, gbps, f"{first:.2f}", err]


def measure_or_report(problem: Problem, name: str, device: str) -> list[str]:
    """measure(); a torch.compile that fails becomes a row saying so instead of ending the run."""
    if name != "compile":
        return measure(problem, name, device)
    try:
        return measure(problem, name, device)
    except Exception as error:  # noqa: BLE001 (any compiler failure is a result here)
        print(f"# {problem.op} {problem.num_tokens} compile failed: {error!r}", file=sys.stderr)
        return [problem.op, str(problem.num_tokens), name, "failed", "-", "-", "-", "-"]


def header(device: str, shape: dict) -> list[str]:
    import triton

    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)"
    shape_text = ", ".join(f"{k} {v}" for k, v in shape.items())
    return [f"# Fused small ops, bf16 ({shape_text})", "",
            f"{name}; torch {torch.__version__}, triton {triton.__version__}; {time.strftime('%Y-%m-%d')}", "",
            "| op | tokens | impl | us/call stream | us/call graph | GB/s graph | first s | max rel err |",
            "|---|---|---|---|---|---|---|---|"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the markdown table to this file")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256, 2048])
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under the Triton interpreter")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are defined, i.e. at import
    elif not torch.cuda.is_available():
        print("bench/fused.py needs CUDA (or --smoke)", file=sys.stderr)
        return 2
    from kubelora.kernels import fused

    device, shape = ("cpu", SMOKE) if args.smoke else ("cuda", LLAMA_7B)
    tokens = [1, 3] if args.smoke else args.tokens
    ops = op_table(fused)
    compiled = {} if args.no_compile or args.smoke else {op: torch.compile(ref) for op, (_, ref) in ops.items()}
    lines = header(device, shape)
    print("\n".join(lines), flush=True)
    for num_tokens in tokens:
        for problem in build_problems(ops, shape, num_tokens, compiled, device):
            for name in problem.impls:
                lines.append("| " + " | ".join(measure_or_report(problem, name, device)) + " |")
                print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
