"""`kubelora` command: entry point only; each subcommand lives in the module that owns the behaviour."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence


def _run_make_tiny_model(args: argparse.Namespace) -> int:
    from kubelora.cli.tiny import make_tiny_model

    sizes = {k: v for k, v in vars(args).items() if k in _SIZE_FLAGS and v is not None}
    out = make_tiny_model(args.dir, arch=args.arch, seed=args.seed, **sizes)
    print(out)
    return 0


def _run_make_adapter(args: argparse.Namespace) -> int:
    from kubelora.cli.tiny import make_adapter

    out = make_adapter(args.dir, args.model, rank=args.rank, alpha=args.alpha, targets=args.targets,
                       seed=args.seed, use_rslora=args.rslora)
    print(out)
    return 0


def _run_demo(args: argparse.Namespace) -> int:
    from kubelora.cli.demo import run_demo

    mode = "offline" if args.offline else "engine" if args.engine_only else "cluster"
    return run_demo(workdir=args.workdir, device=args.device, mode=mode, keep=args.keep)


def _run_engine_serve(args: argparse.Namespace) -> int:
    from kubelora.engine.server.cli import run

    return run(args)


def _run_operator(args: argparse.Namespace) -> int:
    from kubelora.operator.cli import main as operator_main

    return operator_main(args.rest)


def _run_router(args: argparse.Namespace) -> int:
    from kubelora.router.cli import main as router_main

    return router_main(args.rest)


def _run_bench_engine(args: argparse.Namespace) -> int:
    from kubelora.bench.engine import main as bench_main  # imports torch: only when benchmarking

    return bench_main(args.rest)


def _run_bench_kernels(args: argparse.Namespace) -> int:
    from kubelora.bench.kernels import main as bench_main  # imports torch: only when benchmarking

    return bench_main(args.rest)


def _run_bench_hostile(args: argparse.Namespace) -> int:
    from kubelora.bench.hostile import main as bench_main

    return bench_main(args.rest)


def _run_bench_placement(args: argparse.Namespace) -> int:
    from kubelora.bench.placement_sim import main as bench_main

    return bench_main(args.rest)


def _run_bench_router_keys(args: argparse.Namespace) -> int:
    from kubelora.bench.router_keys import main as bench_main

    return bench_main(args.rest)


def _run_bench_serve(args: argparse.Namespace) -> int:
    from kubelora.bench.serve import main as bench_main

    return bench_main(args.rest)


def _run_bench_operator(args: argparse.Namespace) -> int:
    from kubelora.bench.operator import main as bench_main

    return bench_main(args.rest)


_SIZE_FLAGS = {
    "hidden_size": "--hidden",
    "num_layers": "--layers",
    "num_heads": "--heads",
    "num_kv_heads": "--kv-heads",
    "intermediate_size": "--intermediate",
    "vocab_size": "--vocab",
    "max_position_embeddings": "--max-positions",
}


def _add_make_tiny_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-tiny-model", help="write a random tiny Hugging Face model directory")
    p.add_argument("dir")
    p.add_argument("--arch", choices=["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3"],
                   default="llama")
    p.add_argument("--seed", type=int, default=0)
    for dest, flag in _SIZE_FLAGS.items():
        p.add_argument(flag, dest=dest, type=int, default=None)
    p.set_defaults(func=_run_make_tiny_model)


def _add_make_adapter(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-adapter", help="write a PEFT LoRA adapter for a model directory")
    p.add_argument("dir")
    p.add_argument("--model", required=True, help="base model directory")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16)
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj", help="comma list or all-linear")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rslora", action="store_true", help="rank-stabilised scaling alpha/sqrt(r)")
    p.set_defaults(func=_run_make_adapter)


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the whole system on this machine, on a tiny built-in model")
    p.add_argument("--workdir", default=None, help="where to build the tiny model and adapters")
    p.add_argument("--device", default="cpu")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--engine-only", action="store_true", help="one engine server on loopback, no Kubernetes")
    mode.add_argument("--offline", action="store_true", help="the offline LLM API, no server")
    p.add_argument("--keep", action="store_true", help="leave the local cluster running afterwards")
    p.set_defaults(func=_run_demo)


def _add_engine(sub: argparse._SubParsersAction) -> None:
    engine = sub.add_parser("engine", help="the data plane").add_subparsers(dest="engine_command", required=True)
    serve = engine.add_parser("serve", help="serve a model and its adapters over the OpenAI API")
    from kubelora.engine.server.cli import add_arguments

    add_arguments(serve)
    serve.set_defaults(func=_run_engine_serve)


def _add_passthrough(sub: argparse._SubParsersAction, name: str, help_text: str, func) -> None:
    """Subcommands whose module owns its own argument parser (`kubelora NAME --help` shows it)."""
    p = sub.add_parser(name, help=help_text, add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=func)


def _add_operator(sub: argparse._SubParsersAction) -> None:
    _add_passthrough(sub, "operator", "run the kopf control plane (LoRAPool, LoRAAdapter)", _run_operator)


def _add_router(sub: argparse._SubParsersAction) -> None:
    _add_passthrough(sub, "router", "run the adapter-affinity router of one pool", _run_router)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks (side by side with baselines, in one run)")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    _add_passthrough(kinds, "kernels", "LoRA kernels vs PyTorch baselines and the bytes floor (CUDA)",
                     _run_bench_kernels)
    _add_passthrough(kinds, "engine", "the engine end to end: base, many adapters, prefill, transformers, HTTP "
                     "(CUDA)", _run_bench_engine)
    _add_passthrough(kinds, "hostile", "one tenant's worst allowed requests against a live server: /health and "
                     "a victim request's latency", _run_bench_hostile)
    _add_passthrough(kinds, "placement", "demand placement against least-loaded routing and single-copy affinity, "
                     "simulated (no cluster)", _run_bench_placement)
    _add_passthrough(kinds, "router-keys", "tenant API keys at the router: its CPU per request and the latency "
                     "added, keys on against off", _run_bench_router_keys)
    _add_passthrough(kinds, "serve", "real traffic through HTTP: Poisson arrivals, Zipf tenants, multi-turn chats; "
                     "prefix cache on against off, S-LoRA's retention", _run_bench_serve)
    _add_passthrough(kinds, "operator", "the operator at fleet scale against a real API server, engine pods stood "
                     "in by fakes", _run_bench_operator)


_SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_make_tiny_model,
    _add_make_adapter,
    _add_demo,
    _add_engine,
    _add_operator,
    _add_router,
    _add_bench,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kubelora", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _SUBCOMMANDS:
        add(sub)
    return parser


# Command words whose module owns its parser; argparse's REMAINDER would refuse options right after them.
_PASSTHROUGH = {("operator",): _run_operator, ("router",): _run_router, ("bench", "kernels"): _run_bench_kernels,
                ("bench", "engine"): _run_bench_engine, ("bench", "hostile"): _run_bench_hostile,
                ("bench", "router-keys"): _run_bench_router_keys, ("bench", "placement"): _run_bench_placement,
                ("bench", "operator"): _run_bench_operator, ("bench", "serve"): _run_bench_serve}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    for words, run in _PASSTHROUGH.items():
        if tuple(argv[: len(words)]) == words:
            rest = argv[len(words) :]
            return run(argparse.Namespace(rest=rest[1:] if rest[:1] == ["--"] else rest))
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
