"""`kubelora operator [flags]`: parse flags and env, then run kopf in this process with our handlers."""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Sequence

from kubelora.operator.settings import DefaultImages, OperatorSettings

ENV_PREFIX = "KUBELORA_OPERATOR_"


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(ENV_PREFIX + name, default)


def build_parser() -> argparse.ArgumentParser:
    defaults = OperatorSettings()
    parser = argparse.ArgumentParser(prog="kubelora operator",
                                     description="Run the kubelora control plane (LoRAPool, LoRAAdapter).")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=None,
                       help="watch this namespace (repeatable; env KUBELORA_OPERATOR_NAMESPACES, comma-separated)")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch the whole cluster (default)")
    parser.add_argument("--liveness", type=int, default=_int_env("LIVENESS_PORT"), metavar="PORT",
                        help="serve kopf's liveness probe on http://0.0.0.0:PORT/healthz")
    parser.add_argument("--resync-seconds", type=float, default=_float_env("RESYNC_S", defaults.resync_s),
                        help=f"reconcile each pool at least this often (default {defaults.resync_s})")
    parser.add_argument("--max-concurrent-calls", type=int,
                        default=_int_env("MAX_CONCURRENT_CALLS") or defaults.max_concurrent_calls,
                        help="engine load/unload calls in flight per pool")
    parser.add_argument("--engine-timeout-seconds", type=float,
                        default=_float_env("ENGINE_TIMEOUT_S", defaults.engine_timeout_s))
    parser.add_argument("--backoff-initial-seconds", type=float,
                        default=_float_env("BACKOFF_INITIAL_S", defaults.backoff_initial_s))
    parser.add_argument("--backoff-max-seconds", type=float,
                        default=_float_env("BACKOFF_MAX_S", defaults.backoff_max_s))
    parser.add_argument("--verbose", action="store_true", default=_env("VERBOSE", "") in ("1", "true"))
    parser.add_argument("--engine-image", default=_env("ENGINE_IMAGE") or defaults.images.engine,
                        help=f"engine image of pools that name none (default {defaults.images.engine})")
    parser.add_argument("--router-image", default=_env("ROUTER_IMAGE") or defaults.images.router,
                        help=f"router image of pools that name none (default {defaults.images.router})")
    return parser


def _int_env(name: str) -> int | None:
    value = _env(name)
    return int(value) if value else None


def _float_env(name: str, default: float) -> float:
    value = _env(name)
    return float(value) if value else default


def settings_from_args(args: argparse.Namespace) -> OperatorSettings:
    return OperatorSettings(resync_s=args.resync_seconds, max_concurrent_calls=args.max_concurrent_calls,
                            engine_timeout_s=args.engine_timeout_seconds,
                            backoff_initial_s=args.backoff_initial_seconds, backoff_max_s=args.backoff_max_seconds,
                            images=DefaultImages(engine=args.engine_image, router=args.router_image))


def settings_from_env() -> OperatorSettings:
    """For `kopf run -m kubelora.operator.main`, where no flags reach us: the environment and defaults."""
    return settings_from_args(build_parser().parse_args([]))


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    if argv[:1] == ["--"]:  # `kubelora operator -- --namespace x`: the separator some parsers pass through
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        print(f"kubelora operator: {exc}")
        return 2
    namespaces = args.namespace or [n for n in (_env("NAMESPACES") or "").split(",") if n]
    return run(settings, namespaces, args.liveness, args.verbose)


def run(settings: OperatorSettings, namespaces: list[str], liveness_port: int | None, is_verbose: bool) -> int:
    import kopf

    from kubelora.operator import handlers  # noqa: F401  (registers the handlers)

    kopf.configure(verbose=is_verbose)
    liveness = f"http://0.0.0.0:{liveness_port}/healthz" if liveness_port else None
    try:
        kopf.run(standalone=True, clusterwide=not namespaces, namespaces=namespaces or (),
                 liveness_endpoint=liveness, memo=kopf.Memo(operator_settings=settings))
    except (KeyboardInterrupt, asyncio.CancelledError):
        pass
    return 0
