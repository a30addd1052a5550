"""`kubelora router`: flags and environment -> RouterConfig -> the aiohttp router, until SIGTERM/SIGINT.

Exit codes: 0 after a signal, 2 for invalid settings.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import sys
from collections.abc import Callable

from aiohttp import web

from kubelora.engine.router.app import build_app
from kubelora.engine.router.config import RouterConfig, add_arguments, resolve_config
from kubelora.engine.router.sources import ConfigMapSource, FileSource, PlacementStore
from kubelora.engine.server.logs import JsonFormatter, log_event

log = logging.getLogger("kubelora.engine.router")
SHUTDOWN_TIMEOUT_S = 10.0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kubelora router",
                                     description="Route OpenAI requests of a LoRAPool to the replicas holding "
                                                 "their adapter (docs/router.md).")
    add_arguments(parser)
    # A leading "--" (`kubelora router -- --pool p`, the old pass-through form) ends nothing here.
    args = parser.parse_args(argv[1:] if argv[:1] == ["--"] else argv)
    try:
        config = resolve_config(args)
    except ValueError as exc:
        _configure_logging("info")
        log_event(log, "invalid_settings", logging.ERROR, error=str(exc))
        return 2
    _configure_logging(config.log_level)
    log_event(log, "starting", **dataclasses.asdict(config))
    return asyncio.run(serve(config))


def build_source(config: RouterConfig) -> FileSource | ConfigMapSource:
    if config.placement_file:
        return FileSource(config.placement_file, config.poll_interval)
    return ConfigMapSource(config.namespace, config.placement_configmap, config.kubeconfig, config.poll_interval)


async def serve(config: RouterConfig, stop: asyncio.Event | None = None,
                on_listening: Callable[[list], None] | None = None) -> int:
    """Run the router until `stop` is set or a signal arrives. `on_listening` gets the bound addresses."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (RuntimeError, ValueError):  # not the main thread (tests): the caller sets `stop`
            pass
    app = build_app(config, PlacementStore(), build_source(config))
    # handler_cancellation: a client that disconnects cancels its handler, which closes the replica connection.
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=SHUTDOWN_TIMEOUT_S, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    log_event(log, "listening", addresses=[list(a)[:2] for a in runner.addresses])
    if on_listening is not None:
        on_listening(list(runner.addresses))
    await stop.wait()
    await runner.cleanup()
    log_event(log, "stopped")
    return 0


def _configure_logging(level: str) -> None:
    """JSON lines on stderr, as the engine writes them (docs/server.md, Logs)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
