"""Run an aiohttp app on host:port until a stop event, SIGTERM/SIGINT, or an optional `until` coroutine ends.

Shared by `kubelora engine serve` and `kubelora router`; each logs with its own logger and decides its exit code.
No torch here: the router imports it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

from aiohttp import web

from kubelora.contract.logs import log_event

SHUTDOWN_TIMEOUT_S = 10.0


def install_stop_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (RuntimeError, ValueError):  # not the main thread (tests): the caller sets `stop`
            pass


async def run_app(app: web.Application, host: str, port: int, log: logging.Logger, *,
                  stop: asyncio.Event | None = None, on_listening: Callable[[list], None] | None = None,
                  until: Callable[[], Awaitable[None]] | None = None, is_access_log: bool = True) -> None:
    """Serve `app` until `stop` is set, a signal arrives or `until()` returns; then clean up.

    `on_listening` gets the bound addresses (port 0 binds a free port). `is_access_log=False` drops aiohttp's
    access log for a caller that logs its own request events.
    """
    stop = stop or asyncio.Event()
    install_stop_signals(stop)
    # handler_cancellation: a client that disconnects cancels its handler, which stops the work done for it
    # (the server aborts its engine requests; the router closes its replica connection).
    options = {} if is_access_log else {"access_log": None}
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=SHUTDOWN_TIMEOUT_S, **options)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    log_event(log, "listening", addresses=[list(a)[:2] for a in runner.addresses])
    if on_listening is not None:
        on_listening(list(runner.addresses))
    await _wait_first(stop.wait(), until() if until is not None else None)
    await runner.cleanup()


async def _wait_first(*awaitables: Awaitable[None] | None) -> None:
    tasks = [asyncio.ensure_future(a) for a in awaitables if a is not None]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in tasks:
        task.cancel()
