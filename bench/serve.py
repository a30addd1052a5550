"""End-to-end serving benchmark: one engine's tokens/s with many adapters against the same engine on the base model.

`kubelora bench serve [--write docs/serving.md]` builds a random Llama-family model of the asked size and
rank-r PEFT adapters (no hub: the first adapter is written by PEFT, the others are copies of its files
with fresh random values), then runs one batch of requests several times in one process: on the base
model (the baseline), spread over N adapters with the Triton LoRA kernels, and spread over the same
adapters with the PyTorch reference backend. Every request generates exactly `output_len` tokens
(greedy, EOS ignored), so the scenarios do the same work apart from LoRA.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass(frozen=True)
class ServeBenchConfig:
    """Model, adapters and workload of one benchmark run."""

    device: str = "cuda"
    hidden_size: int = 2048
    num_layers: int = 16
    num_heads: int = 32
    num_kv_heads: int = 8
    intermediate_size: int = 5632
    vocab_size: int = 4096
    rank: int = 16
    targets: str = "q_proj,k_proj,v_proj,o_proj"
    adapter_counts: tuple[int, ...] = (8, 32)
    num_requests: int = 64
    prompt_len: int = 128
    output_len: int = 128
    max_num_batched_tokens: int = 4096
    is_torch_backend_compared: bool = True
    num_repeats: int = 2  # timed runs per scenario after the warm-up; the table shows the fastest
    profile_dir: str | None = None  # write a cProfile of one more run per scenario here (host time by function)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("rank", "num_requests", "prompt_len", "output_len", "max_num_batched_tokens", "num_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServeBenchConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not self.adapter_counts or min(self.adapter_counts) < 1:
            raise ValueError(f"ServeBenchConfig.adapter_counts must be >= 1 each, got {self.adapter_counts}")


@dataclass(frozen=True)
class Scenario:
    label: str
    num_adapters: int  # 0: the base model
    backend: str


@dataclass
class ScenarioResult:
    scenario: Scenario
    seconds: float
    num_tokens: int  # generated
    num_steps: int
    outputs: dict[str, list[int]] = field(repr=False, default_factory=dict)
    all_seconds: tuple[float, ...] = ()  # every timed repeat

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds

    def ordered_outputs(self) -> list[list[int]]:
        """Generated ids by request index (request ids end in -<index>)."""
        return [ids for _, ids in sorted(self.outputs.items(), key=lambda kv: int(kv[0].rsplit("-", 1)[1]))]


def clone_adapter(src: Path, dst: Path, seed: int) -> Path:
    """A copy of a PEFT adapter directory with fresh random LoRA weights of the same shapes and scale."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "adapter_config.json", dst / "adapter_config.json")
    generator = torch.Generator().manual_seed(seed)
    tensors = load_file(src / "adapter_model.safetensors")
    fresh = {name: (t.float().std() * torch.randn(t.shape, generator=generator)).to(t.dtype).contiguous()
             for name, t in tensors.items()}
    save_file(fresh, dst / "adapter_model.safetensors")
    return dst


def build_assets(config: ServeBenchConfig, workdir: Path) -> tuple[Path, list[Path]]:
    """The model directory and max(adapter_counts) adapter directories."""
    from kubelora.cli.tiny import make_adapter, make_tiny_model

    model = make_tiny_model(workdir / "model", seed=config.seed, hidden_size=config.hidden_size,
                            num_layers=config.num_layers, num_heads=config.num_heads,
                            num_kv_heads=config.num_kv_heads, intermediate_size=config.intermediate_size,
                            vocab_size=config.vocab_size, max_position_embeddings=config.prompt_len + config.output_len)
    first = make_adapter(workdir / "adapter-0", model, rank=config.rank, alpha=2 * config.rank,
                         targets=config.targets, seed=config.seed)
    adapters = [first] + [clone_adapter(first, workdir / f"adapter-{i}", config.seed + i)
                          for i in range(1, max(config.adapter_counts))]
    return model, adapters


def scenarios(config: ServeBenchConfig) -> list[Scenario]:
    runs = [Scenario("base model", 0, "triton")]
    runs += [Scenario(f"{n} adapters", n, "triton") for n in config.adapter_counts]
    if config.is_torch_backend_compared:
        runs += [Scenario("base model, torch backend", 0, "torch")]
        runs += [Scenario(f"{n} adapters, torch backend", n, "torch") for n in config.adapter_counts]
    return runs


def _prompts(config: ServeBenchConfig, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(config.seed)
    ids = torch.randint(3, vocab, (config.num_requests, config.prompt_len), generator=generator)
    return ids.tolist()


def run_scenario(llm, scenario: Scenario, prompts: list[list[int]], config: ServeBenchConfig) -> ScenarioResult:
    """Every prompt once (adapters round robin), timed from the first request to the last token."""
    from kubelora.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=config.output_len, temperature=0.0, ignore_eos=True)
    names = [f"a{i % scenario.num_adapters}" if scenario.num_adapters else None for i in range(len(prompts))]
    pending = [(f"{scenario.label}-{i}", p, n) for i, (p, n) in enumerate(zip(prompts, names))][::-1]
    outputs: dict[str, list[int]] = {}
    num_steps = 0
    _sync(config.device)
    start = time.perf_counter()
    while pending or len(outputs) < len(prompts):
        while pending and llm.engine.has_waiting_room():
            request_id, prompt, name = pending.pop()
            llm.engine.add_request(request_id, prompt, params, name)
        for out in llm.engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.token_ids)
        num_steps += 1
    _sync(config.device)
    seconds = time.perf_counter() - start
    return ScenarioResult(scenario, seconds, sum(len(t) for t in outputs.values()), num_steps, outputs)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_backend(backend: str, runs: list[Scenario], model: Path, adapters: list[Path],
                config: ServeBenchConfig) -> list[ScenarioResult]:
    """One engine with this LoRA backend; a warm-up pass (kernels compiled, adapters resident) per scenario."""
    from kubelora.engine.llm import LLM

    llm = LLM(model, device=config.device, lora_backend=backend, max_loras=max(config.adapter_counts),
              max_lora_rank=config.rank, max_cpu_loras=len(adapters), max_num_seqs=config.num_requests,
              max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=config.prompt_len + config.output_len)
    try:
        for i, path in enumerate(adapters):
            llm.load_adapter(f"a{i}", path)
        prompts = _prompts(config, len(llm.tokenizer))
        results = []
        for scenario in runs:
            run_scenario(llm, scenario, prompts, config)  # warm-up: kernels compiled, adapters on the device
            repeats = [run_scenario(llm, scenario, prompts, config) for _ in range(config.num_repeats)]
            best = min(repeats, key=lambda r: r.seconds)
            best.all_seconds = tuple(r.seconds for r in repeats)
            results.append(best)
            print(format_row(results[-1], results[0]), flush=True)
            if config.profile_dir:
                _profile(llm, scenario, prompts, config)
        return results
    finally:
        llm.close()


def _profile(llm, scenario: Scenario, prompts: list[list[int]], config: ServeBenchConfig) -> None:
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(run_scenario, llm, scenario, prompts, config)
    path = Path(config.profile_dir) / (scenario.label.replace(" ", "_").replace(",", "") + ".txt")
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        stats = pstats.Stats(profiler, stream=out)
        stats.sort_stats("cumulative").print_stats(45)
        stats.sort_stats("tottime").print_stats(30)


def run(config: ServeBenchConfig, workdir: Path) -> list[ScenarioResult]:
    model, adapters = build_assets(config, workdir)
    runs = scenarios(config)
    results = run_backend("triton", [s for s in runs if s.backend == "triton"], model, adapters, config)
    torch_runs = [s for s in runs if s.backend == "torch"]
    if torch_runs:
        results += run_backend("torch", torch_runs, model, adapters, config)
    return results


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement_lines(results: list[ScenarioResult]) -> list[str]:
    """Per adapter count: how far the two LoRA backends' greedy outputs agree, and how far they are from base."""
    by_label = {r.scenario.label: r for r in results}
    base = by_label["base model"].ordered_outputs()
    lines = []
    for r in results:
        other = by_label.get(f"{r.scenario.label}, torch backend")
        if other is None or r.scenario.num_adapters == 0:
            continue
        ours, ref = r.ordered_outputs(), other.ordered_outputs()
        same_first = sum(a[:1] == b[:1] for a, b in zip(ours, ref))
        prefix = sum(_common_prefix(a, b) for a, b in zip(ours, ref)) / len(ours)
        off_base = sum(a[:1] != b[:1] for a, b in zip(ours, base))
        lines.append(f"- {r.scenario.label}: triton and torch backends agree on the first generated token of "
                     f"{same_first} of {len(ours)} requests and on {prefix:.1f} leading tokens on average; "
                     f"{off_base} of {len(ours)} first tokens differ from the base model's")
    return lines


HEADER = ("| scenario | requests | tokens generated | seconds (each repeat) | tokens/s (best) | engine steps | "
          "ms/step | vs base |\n"
          "|---|---|---|---|---|---|---|---|")


def format_row(result: ScenarioResult, base: ScenarioResult) -> str:
    s = result.scenario
    ms_per_step = 1e3 * result.seconds / max(result.num_steps, 1)
    seconds = " / ".join(f"{t:.2f}" for t in result.all_seconds or (result.seconds,))
    return (f"| {s.label} | {len(result.outputs)} | {result.num_tokens} | {seconds} | "
            f"{result.tokens_per_s:.0f} | {result.num_steps} | {ms_per_step:.1f} | "
            f"{result.tokens_per_s / base.tokens_per_s:.2f}x |")


def environment(config: ServeBenchConfig) -> dict[str, str]:
    import transformers
    import triton

    device = torch.cuda.get_device_name() if config.device.startswith("cuda") else "cpu"
    return {"device": device, "torch": torch.__version__, "triton": triton.__version__,
            "transformers": transformers.__version__, "date": datetime.date.today().isoformat()}


def write_markdown(path: str, config: ServeBenchConfig, env: dict[str, str], results: list[ScenarioResult]) -> None:
    shape = {k: v for k, v in vars(config).items() if k not in ("device", "is_torch_backend_compared", "seed")}
    text = [
        "# Serving benchmark: many adapters against the base model, end to end in one engine", "",
        "Written by `kubelora bench serve` (`bench/serve.py`).", "",
        *[f"- {k}: {v}" for k, v in env.items()],
        f"- model and workload: `{json.dumps(shape)}`", "",
        "One engine process, the offline engine loop (no HTTP), bf16 on the GPU. The same requests in every",
        "row: random prompt tokens, greedy, each request generates exactly output_len tokens. Adapters are",
        "assigned round robin; max_loras equals the largest adapter count, so every step runs all of them.",
        "Timed from the first request added to the last token; each row runs once untimed (warm-up), then",
        "num_repeats times, and tokens/s is the fastest repeat's.", "",
        HEADER, *[format_row(r, results[0]) for r in results], "", *agreement_lines(results), "",
    ]
    Path(path).write_text("\n".join(text))


# ServeBenchConfig's integer fields, each a `--kebab-case` flag of the same name.
INT_FIELDS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size", "rank",
              "num_requests", "prompt_len", "output_len", "max_num_batched_tokens")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = ServeBenchConfig()
    parser.add_argument("--write", default=None, help="write the results as markdown to this path")
    parser.add_argument("--device", default=defaults.device)
    for name in INT_FIELDS:
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=int, default=getattr(defaults, name))
    parser.add_argument("--adapters", type=int, nargs="+", default=list(defaults.adapter_counts),
                        help="adapter counts, one scenario each")
    parser.add_argument("--targets", default=defaults.targets)
    parser.add_argument("--no-torch-backend", action="store_true", help="skip the PyTorch reference backend rows")
    parser.add_argument("--repeats", dest="num_repeats", type=int, default=defaults.num_repeats)
    parser.add_argument("--profile-dir", default=None, help="also write a cProfile of each scenario here")
    parser.add_argument("--workdir", default=None, help="where to build the model (default: a temporary folder)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kubelora bench serve", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    sizes = {k: getattr(args, k) for k in (*INT_FIELDS, "num_repeats")}
    config = ServeBenchConfig(device=args.device, adapter_counts=tuple(args.adapters), targets=args.targets,
                              is_torch_backend_compared=not args.no_torch_backend, profile_dir=args.profile_dir,
                              **sizes)
    with tempfile.TemporaryDirectory(prefix="kubelora-bench-serve-") as tmp:
        results = run(config, Path(args.workdir or tmp))
    env = environment(config)
    print("\n".join(f"{k}: {v}" for k, v in env.items()))
    print(HEADER + "\n" + "\n".join(format_row(r, results[0]) for r in results), flush=True)
    print("\n".join(agreement_lines(results)), flush=True)
    if args.write:
        write_markdown(args.write, config, env, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
