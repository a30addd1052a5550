"""End-to-end engine benchmark: `kubelora bench engine [--write docs/benchmarks-engine.md] [--json FILE]`.

One run writes a random bf16 model of the Llama-2-7B shape and PEFT adapters from tensors made on the device,
then times, each row in a fresh offline `LLM` where its engine settings differ: our base model at several batch
sizes; batches over many adapters (distinct counts, mixed ranks against their mean rank, all-linear, adapters
registered but unused, a device budget smaller than the adapters in flight, the engine's defaults); prefill
against the device's matmul rate; transformers with a static cache and torch.compile in a subprocess; the bytes
floor from the measured copy bandwidth; `kubelora engine serve` under streaming HTTP clients; and the base batch
with `--structured-requests` of its requests constrained by a grammar (a JSON schema, a regex), against the same
batch unconstrained. It prints the report (bench/engine_report.py) and the targets of issues 15 and 16, met or
missed by how much.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from kubelora.bench import engine_rows
from kubelora.bench.engine_assets import SHAPES, ModelShape, shape_of, with_overrides, write_adapters, write_model
from kubelora.bench.engine_device import copy_bandwidth, environment, free_device, matmul_flops
from kubelora.bench.engine_plan import DEFAULT_SCENARIOS, SCENARIOS, EngineBenchConfig, adapter_plan
from kubelora.bench.engine_report import BenchResult, render_markdown


def prepare_model(config: EngineBenchConfig, model_dir: Path) -> tuple[Path, ModelShape]:
    """An existing model directory as is, or a new one of config.shape."""
    if (model_dir / "config.json").exists():
        return model_dir, shape_of(model_dir)
    write_model(model_dir, config.shape, config.device, config.seed)
    return model_dir, config.shape


def prepare_adapters(config: EngineBenchConfig, shape: ModelShape, model_dir: Path, root: Path) -> dict[str, Path]:
    """Every adapter of the plan under root/<name>; directories already there with the same rank are kept."""
    specs = adapter_plan(config).all()
    missing = [s for s in specs if not _has_adapter(root / s.name, s.rank, s.targets)]
    write_adapters(root, missing, shape, model_dir, config.device, config.seed)
    return {s.name: root / s.name for s in specs}


def _has_adapter(path: Path, rank: int, targets: tuple[str, ...]) -> bool:
    try:
        found = json.loads((path / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return False
    return (found.get("r") == rank and set(found.get("target_modules", ())) == set(targets)
            and (path / "adapter_model.safetensors").exists())


def run(config: EngineBenchConfig, workdir: Path, model_dir: Path | None = None) -> BenchResult:
    result = BenchResult(config=config, env=environment(config.device))
    clock = result.stage
    with clock("device rates"):
        result.copy_bytes_per_s = copy_bandwidth(config.device, config.copy_bytes)
        result.matmul_flops = matmul_flops(config.device, config.matmul_size)
    with clock("model directory"):
        model_dir, result.shape = prepare_model(config, model_dir or workdir / "model")
    with clock("adapters"):
        paths = prepare_adapters(config, result.shape, model_dir, workdir / "adapters")
    bench = engine_rows.EngineRows(config, result, model_dir, paths)
    if config.has("hf"):
        with clock("compiled transformers (subprocess)"):
            bench.run_hf(workdir / "hf.json")
    for name, step in bench.offline_steps():
        with clock(name):
            step()
        free_device(config.device)  # again after a failed step, once its traceback is gone
    if config.has("http"):
        with clock("HTTP server"):
            bench.run_http(workdir / "server.log")
    return result


# ---- command line ----

# EngineBenchConfig fields set by flags: integers, then comma-separated integer lists.
_INT_FLAGS = {"prompt_len": "--prompt-len", "output_len": "--output-len", "num_repeats": "--repeats",
              "warmup_tokens": "--warmup-tokens", "batch": "--batch", "num_adapters": "--num-adapters",
              "num_registered": "--num-registered", "rank": "--rank", "budget_adapters": "--budget-adapters",
              "prefill_prompts": "--prefill-prompts", "prefill_len": "--prefill-len",
              "prefill_adapters": "--prefill-adapters", "structured_requests": "--structured-requests",
              "matmul_size": "--matmul-size",
              "profile_steps": "--profile-steps", "seed": "--seed"}
_LIST_FLAGS = {"base_batches": "--base-batches", "adapter_counts": "--adapter-counts", "mixed_ranks": "--mixed-ranks",
               "hf_batches": "--hf-batches"}
_SHAPE_FLAGS = {"hidden_size": "--hidden", "num_layers": "--layers", "num_heads": "--heads",
                "num_kv_heads": "--kv-heads", "intermediate_size": "--intermediate", "vocab_size": "--vocab"}


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


# `--preset smoke`: every scenario at a size the CPU runs in seconds (the CPU test, `bench/engine.sh` here);
# flags given beside it still win.
SMOKE = {"device": "cpu", "shape": "tiny", "num_repeats": 1, "warmup_tokens": 2, "prompt_len": 8, "output_len": 4,
         "base_batches": (1, 4), "batch": 4, "adapter_counts": (2, 4), "num_adapters": 2, "num_registered": 6,
         "mixed_ranks": (8, 24), "budget_adapters": 1, "prefill_prompts": 2, "prefill_len": 16, "prefill_adapters": 2,
         "structured_requests": 2, "matmul_size": 64, "copy_mib": 4, "hf_batches": (1, 4), "profile_steps": 2}


def build_parser(preset: str | None = None) -> argparse.ArgumentParser:
    defaults = EngineBenchConfig()
    parser = argparse.ArgumentParser(prog="kubelora bench engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=["smoke"], help="small sizes for a CPU smoke run")
    parser.add_argument("--write", help="write the markdown report to this file (it is always printed)")
    parser.add_argument("--json", help="write every raw number to this JSON file")
    parser.add_argument("--device", default=defaults.device)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="7b", help="model shape to write")
    parser.add_argument("--model-dir", type=Path, help="use this model directory (written here when it has none)")
    parser.add_argument("--workdir", type=Path, help="model and adapters (default: a temporary folder)")
    parser.add_argument("--scenarios", default=",".join(DEFAULT_SCENARIOS),
                        help=f"comma list of {','.join(SCENARIOS)} (default: all but torch-backend)")
    for dest, flag in _INT_FLAGS.items():
        parser.add_argument(flag, dest=dest, type=int, default=getattr(defaults, dest))
    for dest, flag in _LIST_FLAGS.items():
        parser.add_argument(flag, dest=dest, type=_int_list, default=getattr(defaults, dest), help="comma list")
    for dest, flag in _SHAPE_FLAGS.items():
        parser.add_argument(flag, dest=dest, type=int, help="override the shape's value")
    parser.add_argument("--copy-mib", type=int, default=defaults.copy_bytes >> 20, help="copy-bandwidth buffer")
    parser.add_argument("--max-num-batched-tokens", type=int, help="offline engines only (the server has no flag)")
    parser.add_argument("--hf-timeout", type=float, default=defaults.hf_timeout_s, help="seconds")
    parser.add_argument("--server-timeout", type=float, default=defaults.server_timeout_s, help="seconds to /ready")
    parser.add_argument("--enforce-eager", action="store_true", help="offline engines without CUDA graphs")
    parser.add_argument("--profile", action="store_true", help="torch.profiler split of two decode rows")
    if preset == "smoke":
        parser.set_defaults(**SMOKE)
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    preset = argparse.ArgumentParser(add_help=False)
    preset.add_argument("--preset")
    return build_parser(preset.parse_known_args(argv)[0].preset).parse_args(argv)


def config_from_args(args: argparse.Namespace) -> EngineBenchConfig:
    shape = with_overrides(SHAPES[args.shape], **{k: getattr(args, k) for k in _SHAPE_FLAGS})
    scenarios = tuple(s.strip() for s in args.scenarios.split(",") if s.strip())
    return EngineBenchConfig(
        device=args.device, shape=shape, scenarios=scenarios, copy_bytes=args.copy_mib << 20,
        hf_timeout_s=args.hf_timeout, server_timeout_s=args.server_timeout, is_eager=args.enforce_eager,
        is_profiled=args.profile, max_num_batched_tokens=args.max_num_batched_tokens,
        **{k: getattr(args, k) for k in (*_INT_FLAGS, *_LIST_FLAGS)})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = config_from_args(args)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kubelora-bench-engine-") as tmp:
        result = run(config, args.workdir or Path(tmp), args.model_dir)
    result.total_s = time.perf_counter() - start
    text = render_markdown(result)
    print(text, flush=True)
    if args.write:
        Path(args.write).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(result.as_dict(), indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
