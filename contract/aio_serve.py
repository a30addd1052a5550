"""Run an aiohttp app on host:port until a stop event, SIGTERM/SIGINT, or an optional `until` coroutine ends.

Shared by `kubelora engine serve` and `kubelora router`; each logs with its own logger and decides its exit code.
Every runner comes from `app_runner`, whose connections answer a request aiohttp's parser refuses with
`connection_error`'s fixed body: aiohttp's own body quotes the offending bytes back (a malformed `Authorization`
header: a tenant's API key or the admin token). No torch here: the router imports it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

from aiohttp import web, web_protocol

from kubelora.contract.http_errors import connection_error, error_response
from kubelora.contract.logs import log_event

SHUTDOWN_TIMEOUT_S = 10.0


def install_stop_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (RuntimeError, ValueError):  # not the main thread (tests): the caller sets `stop`
            pass


class _ConnectionHandler(web_protocol.RequestHandler):
    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        # aiohttp's own handling logs (redacted by contract/http_logs.py) and refuses to answer after a byte of
        # the response went out; its body (`message`, the parser's text) is replaced.
        super().handle_error(request, status, exc, "")
        response = error_response(connection_error(status))
        response.force_close()
        return response


class _Server(web.Server):
    def __call__(self) -> web_protocol.RequestHandler:
        return _ConnectionHandler(self, loop=self._loop, **self._kwargs)


class _AppRunner(web.AppRunner):
    async def _make_server(self) -> web.Server:
        # The app's own server (its handler, request factory and handler_args), with our connection handler.
        # aiohttp offers no public hook for the handler's class: _make_server and Server._kwargs are internals
        # (aiohttp 3.14); the engine's and the router's raw-socket tests fail if they change.
        server = await super()._make_server()
        return _Server(server.request_handler, request_factory=server.request_factory,
                       handler_cancellation=server.handler_cancellation, **server._kwargs)


def app_runner(app: web.Application, *, is_access_log: bool = True) -> web.AppRunner:
    """A runner for `app` (not yet set up) whose connections never quote a malformed request back.

    handler_cancellation: a client that disconnects cancels its handler, which stops the work done for it (the
    server aborts its engine requests; the router closes its replica connection). `is_access_log=False` drops
    aiohttp's access log for a caller that logs its own request events.
    """
    options = {} if is_access_log else {"access_log": None}
    return _AppRunner(app, handler_cancellation=True, shutdown_timeout=SHUTDOWN_TIMEOUT_S, **options)


async def run_app(app: web.Application, host: str, port: int, log: logging.Logger, *,
                  stop: asyncio.Event | None = None, on_listening: Callable[[list], None] | None = None,
                  until: Callable[[], Awaitable[None]] | None = None, is_access_log: bool = True) -> None:
    """Serve `app` until `stop` is set, a signal arrives or `until()` returns; then clean up.

    `on_listening` gets the bound addresses (port 0 binds a free port); `is_access_log` as in `app_runner`.
    """
    stop = stop or asyncio.Event()
    install_stop_signals(stop)
    runner = app_runner(app, is_access_log=is_access_log)
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
