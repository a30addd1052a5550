"""Host time per LoRA call on the GPU: what a step's layers pay on the CPU for each `add_lora` (no CUDA graph).

`python -P -m kubelora.bench.host [--calls N] [--steps N] [--profile]`: at the serving benchmark's sizes (hidden 2048, q
2048, k and v 512, 16 layers, adapters on q/k/v/o), one step's metadata, then N calls of the
Triton op on it as a step's layers make them, timed on the host (the GPU runs behind; a synchronize at the end).
Beside it, for scale, one elementwise torch launch and the base projection's matmul. Then whole steps of the
engine's LoRA host work: the step's metadata for every projection kind and each layer's four `add_lora` calls
(the MLP's two return at once). This is the LoRA share of a step's host time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from kubelora.kernels import lora_launch
from kubelora.bench.baselines import build_sets
from kubelora.kernels.lora import add_lora, prepare_lora_projs, prepare_lora_step

HIDDEN = 2048
WIDTHS = [2048, 512, 512]
LAYERS = 16


def host_us(fn, calls: int) -> float:
    """Microseconds of host time per call, after warm-up; the queue is drained before and after."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def launch_parts(call, calls: int) -> dict[str, float]:
    """Host us per call of the pieces of one kernel launch: the specialization check and the compiled launch."""
    seen = []
    original = lora_launch.RepeatLaunch.__call__

    def record(self, *args):
        seen.append((self, args))
        original(self, *args)

    lora_launch.RepeatLaunch.__call__ = record
    try:
        call()
    finally:
        lora_launch.RepeatLaunch.__call__ = original
    parts = {}
    for name, (launch, args) in zip(("shrink", "expand"), seen):
        parts[f"{name} check"] = host_us(lambda: launch._specialization.holds(args), calls)  # noqa: B023
        direct = lambda: launch._kernel[launch._grid3](*args, *launch._tail)  # noqa: B023, E731
        parts[f"{name} launch"] = host_us(direct, calls)
        parts[f"{name} whole"] = host_us(lambda: launch(*args), calls)  # noqa: B023
    return parts


def step_ms(slots: list[int], adapters: int, rank: int, steps: int) -> float:
    """Host ms per step of the engine's LoRA work (metadata, then LAYERS x the qkv, o, gate_up, down calls)."""
    to = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(len(slots), HIDDEN, **to)
    rows = adapters * rank
    pools = {kind: ([torch.randn(rows, HIDDEN, **to) for _ in widths], [torch.randn(rows, w, **to) for w in widths])
             for kind, widths in (("qkv", WIDTHS), ("o", [HIDDEN]), ("gate_up", [64, 64]), ("down", [HIDDEN]))}
    ys = {kind: torch.zeros(len(slots), sum(b.shape[1] for b in pool[1]), **to) for kind, pool in pools.items()}

    def tables(num_slices: int, adapted: bool) -> tuple[list, list, list]:
        return ([[a * rank] * num_slices for a in range(adapters)], [[rank if adapted else 0] * num_slices] * adapters,
                [[0.5] * num_slices] * adapters)

    kinds = {"qkv": tables(3, True), "o": tables(1, True), "gate_up": tables(2, False), "down": tables(1, False)}

    def one_step() -> None:
        step = prepare_lora_step(slots, adapters, "cuda")
        projs = prepare_lora_projs(kinds, "cuda")
        for _ in range(LAYERS):
            for kind, (lora_a, lora_b) in pools.items():
                add_lora(ys[kind], x, lora_a, lora_b, projs[kind], step, backend="triton")

    return host_us(one_step, steps) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--only-steps", action="store_true", help="time whole steps only (the lowest of 5 trials)")
    parser.add_argument("--profile", action="store_true", help="cProfile the LoRA calls of the first shape")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for tokens, adapters, rank in () if args.only_steps else ((64, 32, 16), (64, 8, 16), (256, 32, 16)):
        slots = [i % adapters for i in range(tokens)]
        step = prepare_lora_step(slots, adapters, "cuda")
        (st,) = build_sets(slots, [rank] * adapters, WIDTHS, HIDDEN, 1, step, torch.bfloat16)
        weight = torch.randn(HIDDEN, sum(WIDTHS), device="cuda", dtype=torch.bfloat16)
        lora_call = lambda: add_lora(st.y, st.x, st.lora_a, st.lora_b, st.proj, st.step, backend="triton")  # noqa: E731
        times = {
            "add_lora (triton)": host_us(lora_call, args.calls),
            "one torch add_": host_us(lambda: st.y.add_(0), args.calls),
            "base matmul": host_us(lambda: torch.matmul(st.x, weight), args.calls),
        }
        times.update(launch_parts(lora_call, args.calls))
        print(f"{tokens} x {adapters} x {rank}: " + ", ".join(f"{k} {v:.1f} us" for k, v in times.items()), flush=True)
        if args.profile and tokens == 64 and adapters == 32:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(args.calls):
                lora_call()
            profiler.disable()
            torch.cuda.synchronize()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
    for tokens, adapters, rank in ((64, 32, 16), (64, 8, 16)):
        slots = [i % adapters for i in range(tokens)]
        trials = [step_ms(slots, adapters, rank, args.steps) for _ in range(5 if args.only_steps else 1)]
        print(f"{tokens} x {adapters} x {rank}: LoRA host work per step ({LAYERS} layers) {min(trials):.2f} ms "
              f"(trials: {' '.join(f'{t:.2f}' for t in trials)})", flush=True)


if __name__ == "__main__":
    main()
