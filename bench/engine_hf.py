"""The engine benchmark's baseline: the model's own transformers class (AutoModelForCausalLM: Llama, Qwen3, Gemma 2,
Phi-3 ...) with a static cache and its own torch.compile.

Run in a subprocess of the benchmark (`python -P bench/engine_hf.py --model-dir DIR ... --json OUT`), so that
its compiled graphs and allocator state never share a process with our engine. For each batch size: one
warm-up `generate` of the timed length (the static cache's shape: compiles the decode step and records its CUDA
graphs once), then timed greedy `generate`
calls that always produce output_len tokens. A streamer stamps each step's tokens after a device sync; the
decode ms/step is the median gap between stamps (the first two gaps, prefill and first decode, left out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


class StepClock:
    """A generate() streamer: one timestamp per put (the prompt first, then each step's tokens)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.stamps: list[float] = []

    def put(self, value) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def _generate(model, prompts: torch.Tensor, num_tokens: int, device: str, is_compiled: bool) -> StepClock:
    clock = StepClock(device)
    model.generate(prompts, max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False,
                   cache_implementation="static", disable_compile=not is_compiled, streamer=clock,
                   attention_mask=torch.ones_like(prompts), pad_token_id=0)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    clock.stamps.append(time.perf_counter())
    return clock


def time_batch(model, batch: int, args: argparse.Namespace) -> dict:
    generator = torch.Generator().manual_seed(args.seed + batch)
    prompts = torch.randint(10, model.config.vocab_size, (batch, args.prompt_len), generator=generator).to(args.device)
    start = time.perf_counter()
    _generate(model, prompts, args.output_len, args.device, args.compile)  # the timed shapes: compiled once
    warmup_s = time.perf_counter() - start
    runs = []
    for _ in range(args.repeats):
        clock = _generate(model, prompts, args.output_len, args.device, args.compile)
        gaps = [1e3 * (b - a) for a, b in zip(clock.stamps[1:-1], clock.stamps[2:-1])][2:]
        seconds = clock.stamps[-1] - clock.stamps[0]
        runs.append({"seconds": seconds, "decode_ms": statistics.median(gaps) if gaps else None,
                     "num_tokens": batch * args.output_len, "tokens_per_s": batch * args.output_len / seconds,
                     "ttft_s": clock.stamps[1] - clock.stamps[0] if len(clock.stamps) > 2 else None})
    return {"batch": batch, "warmup_s": warmup_s, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    start = time.perf_counter()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype).to(args.device).eval()
    result = {"load_s": time.perf_counter() - start, "is_compiled": args.compile, "dtype": str(dtype),
              "batches": []}
    with torch.inference_mode():
        for batch in (int(b) for b in args.batches.split(",")):
            result["batches"].append(time_batch(model, batch, args))
            print(json.dumps(result["batches"][-1]), flush=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def run_baseline(model_dir: Path, out_json: Path, device: str, batches: tuple[int, ...], prompt_len: int,
                 output_len: int, repeats: int, is_compiled: bool, timeout_s: float) -> dict:
    """This file as a subprocess; its JSON, or {"error": ...} when it failed or ran out of time."""
    command = [sys.executable, "-P", __file__, "--model-dir", str(model_dir), "--device", device,
               "--batches", ",".join(map(str, batches)), "--prompt-len", str(prompt_len),
               "--output-len", str(output_len), "--repeats", str(repeats),
               "--compile" if is_compiled else "--no-compile", "--json", str(out_json)]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    if done.returncode != 0 or not out_json.exists():
        return {"error": f"exit {done.returncode}: {done.stderr.strip()[-1500:]}"}
    result = json.loads(out_json.read_text())
    result["wall_s"] = time.perf_counter() - start
    return result


if __name__ == "__main__":
    raise SystemExit(main())
