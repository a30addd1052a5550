"""`kubelora router`: flags and environment -> RouterConfig -> the aiohttp router, until SIGTERM/SIGINT.

Exit codes: 0 after a signal, 2 for invalid settings.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
from collections.abc import Callable

from kubelora.contract.aio_serve import run_app
from kubelora.contract.logs import install_json_handler, log_event
from kubelora.router.app import build_app
from kubelora.router.config import RouterConfig, add_arguments, resolve_config
from kubelora.router.sources import ConfigMapSource, FileSource, PlacementStore

log = logging.getLogger("kubelora.router")


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
        install_json_handler("info")
        log_event(log, "invalid_settings", logging.ERROR, error=str(exc))
        return 2
    install_json_handler(config.log_level)
    log_event(log, "starting", **dataclasses.asdict(config))
    return asyncio.run(serve(config))


def build_source(config: RouterConfig) -> FileSource | ConfigMapSource:
    if config.placement_file:
        return FileSource(config.placement_file, config.poll_interval)
    return ConfigMapSource(config.namespace, config.placement_configmap, config.kubeconfig, config.poll_interval)


async def serve(config: RouterConfig, stop: asyncio.Event | None = None,
                on_listening: Callable[[list], None] | None = None) -> int:
    """Run the router until `stop` is set or a signal arrives. `on_listening` gets the bound addresses."""
    app = build_app(config, PlacementStore(), build_source(config))
    await run_app(app, config.host, config.port, log, stop=stop, on_listening=on_listening, is_access_log=False)
    log_event(log, "stopped")
    return 0

