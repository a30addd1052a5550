"""End-to-end engine benchmark: `kubelora bench engine [--write docs/benchmarks-engine.md] [--json FILE]`.

One run writes a random bf16 model of one shape (`--shape`: Llama-2-7B by default, or another family's checkpoint:
Qwen3-8B, Gemma-2-9B, Phi-4) and PEFT adapters from tensors made on the device,
then times, each row in a fresh offline `LLM` where its engine settings differ: our base model at several batch
sizes; batches over many adapters (distinct counts, mixed ranks against their mean rank, all-linear, adapters
registered but unused, a device budget smaller than the adapters in flight, the engine's defaults); prefill
against the device's matmul rate; transformers with a static cache and torch.compile in a subprocess; the bytes
floor from the measured copy bandwidth; `kubelora engine serve` under streaming HTTP clients; and the base batch
with `--structured-requests` of its requests constrained by a grammar (a JSON schema, a regex), against the same
batch unconstrained; when named (`--preset long-context`), decode at long contexts against the bytes floor
(bench/engine_long_context.py). It prints the report (bench/engine_report.py) and its targets
(bench/engine_targets.py), met or missed by how much. With `--checkpoint FILE` one run can span several processes
on one machine (bench/engine_checkpoint.py), for device calls shorter than a whole run.
"""

from __future__ import annotations

import argparse
import os
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kubelora.bench import engine_rows
from kubelora.bench.engine_assets import SHAPES, ModelShape, shape_of, with_overrides, write_adapters, write_model
from kubelora.bench.engine_checkpoint import UNFINISHED_EXIT, Checkpoint, CheckpointMismatch, machine_id
from kubelora.bench.engine_device import copy_bandwidth, environment, free_device, matmul_flops
from kubelora.bench.engine_plan import DEFAULT_SCENARIOS, SCENARIOS, EngineBenchConfig, adapter_plan
from kubelora.bench.engine_report import BenchResult, render_markdown
from kubelora.bench.engine_targets import reference_share
from kubelora.engine.server.config import engine_switches_from_env


def prepare_model(config: EngineBenchConfig, model_dir: Path) -> tuple[Path, ModelShape]:
    """An existing model directory as is, or a new one of config.shape."""
    if (model_dir / "config.json").exists():
        return model_dir, shape_of(model_dir)
    write_model(model_dir, config.shape, config.device, config.seed)
    return model_dir, config.shape


def prepare_adapters(config: EngineBenchConfig, shape: ModelShape, model_dir: Path, root: Path) -> dict[str, Path]:
    """Every adapter of the plan under root/<name>; directories already there with the same rank are kept."""
    specs = adapter_plan(config).all()
    missing = [s for s in specs if not _has_adapter(root / s.name, s.rank, shape.peft_modules(s.targets))]
    write_adapters(root, missing, shape, model_dir, config.device, config.seed)
    return {s.name: root / s.name for s in specs}


def _has_adapter(path: Path, rank: int, targets: tuple[str, ...]) -> bool:
    try:
        found = json.loads((path / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return False
    return (found.get("r") == rank and set(found.get("target_modules", ())) == set(targets)
            and (path / "adapter_model.safetensors").exists())


def run(config: EngineBenchConfig, workdir: Path, model_dir: Path | None = None,
        checkpoint: Checkpoint | None = None, process: dict | None = None) -> BenchResult:
    """Every stage of the plan. With a checkpoint, the stages an earlier process finished are kept and not run
    again, the result is saved after each stage, and no stage starts once the checkpoint's time is up."""
    if checkpoint is not None and checkpoint.result is not None:
        result = checkpoint.result
    else:
        result = BenchResult(config=config, env=environment(config.device))
    done = checkpoint.done if checkpoint is not None else set()
    result.processes.append(process if process is not None else {"machine": machine_id()})

    def stage(name: str, body: Callable[[], object]) -> bool:
        """body() as the stage `name` unless it is done; False (not run) once the checkpoint's time is up."""
        if name in done:
            print(f"== {name}: done by an earlier process", flush=True)
            return True
        if checkpoint is not None and checkpoint.is_out_of_time():
            print(f"== {name}: left to the next process (--stop-after)", flush=True)
            return False
        result.errors.pop(name, None)
        with result.stage(name):
            body()
        if name not in result.errors:
            done.add(name)
        if checkpoint is not None:
            checkpoint.save(result)
        free_device(config.device)  # again after a failed stage, once its traceback is gone
        return True

    def device_rates() -> None:
        result.copy_bytes_per_s = copy_bandwidth(config.device, config.copy_bytes)
        result.matmul_flops = matmul_flops(config.device, config.matmul_size)

    stage("device rates", device_rates)
    # The model and the adapters: written by the first process, found on disk by a resumed one.
    with result.timed("model directory"):
        model_dir, result.shape = prepare_model(config, model_dir or workdir / "model")
    with result.timed("adapters"):
        paths = prepare_adapters(config, result.shape, model_dir, workdir / "adapters")
    bench = engine_rows.EngineRows(config, result, model_dir, paths)
    steps = [("compiled transformers (subprocess)", lambda: bench.run_hf(workdir / "hf.json"))] \
        if config.has("hf") else []
    steps += bench.offline_steps()
    if config.has("http"):
        steps.append(("HTTP server", lambda: bench.run_http(workdir / "server.log")))
    result.unfinished = [name for name, step in steps if not stage(name, step)]
    return result


# ---- command line ----

# EngineBenchConfig fields set by flags: integers, then comma-separated integer lists.
_INT_FLAGS = {"prompt_len": "--prompt-len", "output_len": "--output-len", "num_repeats": "--repeats",
              "warmup_tokens": "--warmup-tokens", "batch": "--batch", "num_adapters": "--num-adapters",
              "num_registered": "--num-registered", "rank": "--rank", "budget_adapters": "--budget-adapters",
              "prefill_prompts": "--prefill-prompts", "prefill_len": "--prefill-len",
              "prefill_adapters": "--prefill-adapters", "prefill_repeats": "--prefill-repeats",
              "structured_requests": "--structured-requests",
              "matmul_size": "--matmul-size", "server_starts": "--server-starts",
              "profile_steps": "--profile-steps", "long_batch": "--long-batch", "long_adapters": "--long-adapters",
              "seed": "--seed"}
_LIST_FLAGS = {"base_batches": "--base-batches", "adapter_counts": "--adapter-counts", "mixed_ranks": "--mixed-ranks",
               "hf_batches": "--hf-batches", "long_contexts": "--long-contexts"}
_SHAPE_FLAGS = {"hidden_size": "--hidden", "num_layers": "--layers", "num_heads": "--heads",
                "num_kv_heads": "--kv-heads", "intermediate_size": "--intermediate", "vocab_size": "--vocab"}


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


# `--preset smoke`: every scenario at a size the CPU runs in seconds (the CPU test, `bench/engine.sh` here);
# flags given beside it still win.
SMOKE = {"device": "cpu", "shape": "tiny", "num_repeats": 1, "warmup_tokens": 2, "prompt_len": 8, "output_len": 4,
         "base_batches": (1, 4), "batch": 4, "adapter_counts": (2, 4), "num_adapters": 2, "num_registered": 6,
         "mixed_ranks": (8, 24), "budget_adapters": 1, "prefill_prompts": 2, "prefill_repeats": 1, "prefill_len": 16,
         "prefill_adapters": 2, "structured_requests": 2, "matmul_size": 64, "copy_mib": 4, "hf_batches": (1, 4),
         "profile_steps": 2, "server_starts": 2}


# `--preset family`: what the model-family comparison needs of one shape (base decode at batch 1 and 64, 32
# adapters, compiled transformers, the floor, and where those rows' decode time goes: --profile), in one device
# call; flags given beside it still win.
FAMILY = {"scenarios": "base,adapters,hf,floor", "base_batches": (1, 64), "adapter_counts": (32,),
          "num_registered": 32, "profile": True}
# `--preset long-context`: decode at batch 16 at 8k and 32k tokens of context, base and over 16 adapters, against
# the bytes floor, at the Llama-3.1-8B shape (GQA: 128 KiB of KV a token, 64 GiB for 16 x 32k: an H200, not an
# H100); flags given beside it still win (the CPU test: a tiny shape, --long-contexts of a few blocks).
LONG_CONTEXT = {"shape": "8b", "scenarios": "long-context"}
PRESETS = {"smoke": SMOKE, "family": FAMILY, "long-context": LONG_CONTEXT}


def build_parser(preset: str | None = None) -> argparse.ArgumentParser:
    defaults = EngineBenchConfig()
    parser = argparse.ArgumentParser(prog="kubelora bench engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), help="smoke: small sizes for a CPU smoke run; family: "
                        "the model-family comparison's scenarios; long-context: decode at 8k and 32k tokens of "
                        "context at the Llama-3.1-8B shape")
    parser.add_argument("--write", help="write the markdown report to this file (it is always printed)")
    parser.add_argument("--json", help="write every raw number to this JSON file")
    parser.add_argument("--device", default=defaults.device)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="7b", help="model shape to write")
    parser.add_argument("--model-dir", type=Path, help="use this model directory (written here when it has none)")
    parser.add_argument("--workdir", type=Path, help="model and adapters (default: a temporary folder)")
    parser.add_argument("--scenarios", default=",".join(DEFAULT_SCENARIOS),
                        help=f"comma list of {','.join(SCENARIOS)} (default: all but torch-backend and long-context)")
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
    parser.add_argument("--reference", type=Path, help="another run's --json (the Llama-2-7B shape's): this run's base "
                        "share of the bytes floor at --batch is judged against its share")
    parser.add_argument("--checkpoint", type=Path, help="a run over several processes: finished stages are saved "
                        "here and a later process with the same file resumes (bench/engine_checkpoint.py)")
    parser.add_argument("--stop-after", type=float, help="with --checkpoint: start no stage after this many "
                        f"seconds; exit code {UNFINISHED_EXIT} while stages are left")
    if preset in PRESETS:
        parser.set_defaults(**PRESETS[preset])
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    preset = argparse.ArgumentParser(add_help=False)
    preset.add_argument("--preset")
    parser = build_parser(preset.parse_known_args(argv)[0].preset)
    args = parser.parse_args(argv)
    if args.stop_after is not None and args.checkpoint is None:
        parser.error("--stop-after needs --checkpoint (the stages it leaves are resumed from there)")
    return args


def config_from_args(args: argparse.Namespace) -> EngineBenchConfig:
    shape = with_overrides(SHAPES[args.shape], **{k: getattr(args, k) for k in _SHAPE_FLAGS})
    scenarios = tuple(s.strip() for s in args.scenarios.split(",") if s.strip())
    return EngineBenchConfig(
        device=args.device, shape=shape, scenarios=scenarios, copy_bytes=args.copy_mib << 20,
        hf_timeout_s=args.hf_timeout, server_timeout_s=args.server_timeout, is_eager=args.enforce_eager,
        is_profiled=args.profile, max_num_batched_tokens=args.max_num_batched_tokens,
        engine_switches=tuple(sorted(engine_switches_from_env(os.environ).items())),
        **{k: getattr(args, k) for k in (*_INT_FLAGS, *_LIST_FLAGS)})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = config_from_args(args)
    checkpoint = None
    if args.checkpoint is not None:
        if args.workdir is None:  # the model and the adapters must outlive the process
            print("kubelora bench engine: --checkpoint needs --workdir", flush=True)
            return 2
        try:
            checkpoint = Checkpoint.open(args.checkpoint, config, args.stop_after)
        except CheckpointMismatch as exc:
            print(f"kubelora bench engine: {exc}", flush=True)
            return 2
    start = time.perf_counter()
    process = {"machine": machine_id(), "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    with tempfile.TemporaryDirectory(prefix="kubelora-bench-engine-") as tmp:
        result = run(config, args.workdir or Path(tmp), args.model_dir, checkpoint, process)
    process["seconds"] = time.perf_counter() - start
    result.total_s = sum(p["seconds"] for p in result.processes)
    if args.reference is not None:
        result.reference = reference_share(json.loads(args.reference.read_text()), config.batch)
    if checkpoint is not None:
        checkpoint.save(result)
    text = render_markdown(result)
    print(text, flush=True)
    if args.write:
        Path(args.write).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(result.as_dict(), indent=2, default=str) + "\n")
    return UNFINISHED_EXIT if result.unfinished else 0


if __name__ == "__main__":
    raise SystemExit(main())
