"""Structured output's cost: one batch of requests, some constrained by a grammar, against the same batch with
none constrained (tokens/s; the grammar rows' masks are filled on the host each step).

    python -P -m kubelora.bench.structured [--model DIR] [--device cpu|cuda] [--num-requests 64]
        [--num-constrained 8] [--max-tokens 64] [--repeats 3] [--vocab-size 512]

Without --model a random tiny llama (cli/tiny.py) is built in a temporary directory. Every request is greedy
with ignore_eos and the same max_tokens; the constraints (half a JSON schema, half a regex) cannot end
before max_tokens, so both runs generate the same number of tokens. The two batches alternate; prints a
markdown table of tokens/s (the best and the median repeat: on a shared machine the best is the steadier
figure) and the ratio of constrained to unconstrained.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

# Long fixed-length fields keep every constrained request running to max_tokens.
SCHEMA = {"type": "object",
          "properties": {"mode": {"enum": ["train", "car", "plane"]},
                         "days": {"type": "integer", "minimum": 1, "maximum": 30},
                         "notes": {"type": "string", "pattern": "^[a-z ,.]{2000}$"}},
          "required": ["mode", "days", "notes"], "additionalProperties": False}
REGEX = r"([a-z]{3,8}@[a-z]{3,6}\.(com|org|net), ){200}"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (default: a random tiny llama)")
    p.add_argument("--vocab-size", type=int, default=512, help="the tiny model's vocabulary")
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--num-constrained", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    return p.parse_args(argv)


def constraint_specs() -> list:
    """The two constraints (a JSON schema, a regex); the engine benchmark's structured row uses them too."""
    from kubelora.engine.structured import StructuredKind, StructuredOutput

    return [StructuredOutput.json_schema(SCHEMA), StructuredOutput(StructuredKind.REGEX, REGEX)]


def build_params(num: int, num_constrained: int, max_tokens: int) -> list:
    from kubelora.engine import SamplingParams

    specs = constraint_specs()
    every = num // num_constrained if num_constrained else 0
    params = []
    for i in range(num):
        spec = specs[(i // every) % 2] if every and i % every == 0 and i // every < num_constrained else None
        params.append(SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, structured=spec))
    return params


def timed_run(llm, prompts: list[list[int]], params: list) -> tuple[float, int]:
    """(seconds, generated tokens) of one batch through LLM.generate."""
    if llm.engine.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    if llm.engine.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, sum(len(r.token_ids) for r in results)


def measure(llm, args: argparse.Namespace) -> dict[str, list[tuple[float, int]]]:
    vocab = llm.engine.model_config.vocab_size
    prompts = [[1] + [(17 + 31 * i + 7 * j) % (vocab - 20) + 10 for j in range(15)] for i in range(args.num_requests)]
    runs = {"unconstrained": build_params(args.num_requests, 0, args.max_tokens),
            "constrained": build_params(args.num_requests, args.num_constrained, args.max_tokens)}
    for params in runs.values():  # warm-up: compiles the grammars, fills caches
        timed_run(llm, prompts, params)
    times: dict[str, list[tuple[float, int]]] = {name: [] for name in runs}
    for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits both
        for name, params in runs.items():
            times[name].append(timed_run(llm, prompts, params))
    return times


def report(times: dict[str, list[tuple[float, int]]], args: argparse.Namespace) -> str:
    best = {name: max(n / s for s, n in runs) for name, runs in times.items()}
    median = {name: statistics.median(n / s for s, n in runs) for name, runs in times.items()}
    lines = ["| batch | constrained | tokens | tokens/s best | ratio best | tokens/s median | ratio median |",
             "|---|---|---|---|---|---|---|"]
    for name, runs in times.items():
        constrained = args.num_constrained if name == "constrained" else 0
        lines.append(f"| {args.num_requests} | {constrained} | {runs[0][1]} | {best[name]:.0f} | "
                     f"{best[name] / best['unconstrained']:.3f}x | {median[name]:.0f} | "
                     f"{median[name] / median['unconstrained']:.3f}x |")
    return "\n".join(lines)


def main(argv=None) -> None:
    from kubelora.engine import LLM

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from kubelora.cli.tiny import make_tiny_model

            model = make_tiny_model(f"{tmp}/model", arch="llama", seed=0, vocab_size=args.vocab_size)
        llm = LLM(model, device=args.device, max_num_seqs=args.num_requests, max_lora_rank=8, max_cpu_loras=1,
                  max_model_len=args.max_tokens + 64)
        try:
            print(report(measure(llm, args), args))
        finally:
            llm.close()


if __name__ == "__main__":
    main()
