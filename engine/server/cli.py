"""`kubelora engine serve`: flags and environment -> ServerConfig -> the aiohttp server, until SIGTERM/SIGINT.

Exit codes: 0 after a signal, 1 when the engine fails to start, 2 for bad settings.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
from collections.abc import Callable

from aiohttp import web

from kubelora.contract.aio_serve import app_runner, run_app
from kubelora.contract.logs import install_json_handler, log_event
from kubelora.engine.server import config as server_config
from kubelora.engine.server.app import ADMIN_APP, LIFECYCLE, build_app

log = logging.getLogger("kubelora.engine.server")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    server_config.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    try:
        config = server_config.resolve_config(args)
    except (ValueError, OSError) as exc:
        configure_logging("info")
        log_event(log, "invalid_settings", logging.ERROR, error=str(exc))
        return 2
    configure_logging(config.log_level)
    log_event(log, "starting", **_loggable(config))
    if config.admin_token is None:
        log_event(log, "admin_port_open", logging.WARNING, admin_port=config.admin_port,
                  hint="no admin token: anyone who reaches the admin port may load and unload adapters")
    return asyncio.run(serve(build_app(config), config.host, config.port, admin_port=config.admin_port))


def configure_logging(level: str) -> None:
    """JSON lines on stderr for every logger: ours, aiohttp's, Python warnings and transformers'."""
    install_json_handler(level)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # duplicates our request events
    logging.captureWarnings(True)
    from transformers.utils import logging as hf_logging  # its own stderr handler and progress bars: use ours

    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    hf_logging.disable_progress_bar()


def _loggable(config: server_config.ServerConfig) -> dict:
    fields = dataclasses.asdict(config)
    fields["admin_token"] = "<set>" if config.admin_token else None  # never the secret itself
    return fields


async def serve(app: web.Application, host: str, port: int, stop: asyncio.Event | None = None,
                on_listening: Callable[[list], None] | None = None, *, admin_port: int = 0,
                on_admin_listening: Callable[[list], None] | None = None) -> int:
    """Run `app` on `port` and its admin app on `admin_port` until `stop` is set or a signal arrives; 1 when the
    engine fails to start.

    `on_listening` / `on_admin_listening` get the bound addresses (port 0 binds a free port). The admin site
    listens first and closes last, so the operator never sees a serving engine it cannot manage.
    """
    lifecycle = app[LIFECYCLE]
    admin = app_runner(app[ADMIN_APP])
    await admin.setup()
    try:
        await web.TCPSite(admin, host, admin_port).start()
        log_event(log, "admin_listening", addresses=[list(a)[:2] for a in admin.addresses])
        if on_admin_listening is not None:
            on_admin_listening(list(admin.addresses))
        await run_app(app, host, port, log, stop=stop, on_listening=on_listening,
                      until=lambda: _wait_failed(lifecycle))
    finally:
        await admin.cleanup()
    log_event(log, "stopped", is_failure=lifecycle.failure is not None)
    return 1 if lifecycle.failure is not None else 0


async def _wait_failed(lifecycle) -> None:
    await lifecycle.done.wait()
    if lifecycle.failure is None:
        await asyncio.Event().wait()  # started well: wait for the stop signal only
