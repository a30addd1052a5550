"""The aiohttp application: routes, the error middleware, and the engine's start and stop.

Two applications share one engine: `build_app` returns the serving one (OpenAI API, public model list, health,
metrics) and keeps the admin one (adapter load/unload, the operator's model list) under `ADMIN_APP`, for the
admin port. The HTTP server listens before the model is loaded, so `/health` answers at once; `/ready` turns 200 when
the model is loaded, the startup adapters are loaded and the engine thread runs. Engine-backed routes answer
503 until then.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from kubelora.contract.errors import Unavailable
from kubelora.contract.http_errors import HANDLER_ARGS, error_middleware, refuse_encoded_bodies
from kubelora.contract.http_logs import redact_aiohttp_logs
from kubelora.contract.logs import log_event
from kubelora.engine.config import EngineConfig
from kubelora.engine.server.adapter_ops import AdapterOps
from kubelora.engine.server.admin_api import AdminRoutes, admin_auth_middleware
from kubelora.engine.server.async_engine import AsyncEngine
from kubelora.engine.server.config import ServerConfig
from kubelora.engine.server.api_keys import KEY_GATE, KeyGate, key_middleware
from kubelora.engine.server.extra_api import ExtraRoutes
from kubelora.engine.server.metrics import EngineView, ServerMetrics
from kubelora.engine.server.openai_api import OpenAIRoutes
from kubelora.engine.server.serving import Serving
from kubelora.engine.server.source_text import redact_source, source_digest
from kubelora.engine.server.sources import SourceConfig, resolve_source
from kubelora.engine.server.tokenization import PromptTokenizer

log = logging.getLogger("kubelora.engine.server")
MAX_BODY_BYTES = 16 << 20
MIDDLEWARES = [error_middleware, refuse_encoded_bodies]  # error_middleware outermost: every error gets its JSON body
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
GRAPH_CAPTURE_TIMEOUT_S = 120.0  # start-up waits this long at most for the adapters' decode graphs


def build_engine(config: EngineConfig):
    """The default engine factory: an LLMEngine (torch loads here, once the server listens)."""
    from kubelora.engine import LLMEngine

    return LLMEngine(config)


def source_config(config: ServerConfig) -> SourceConfig:
    return SourceConfig(roots=tuple(Path(r) for r in config.adapter_root), allowed_hosts=config.adapter_url_host,
                        allowed_s3_buckets=config.adapter_s3_bucket, allowed_s3_endpoints=config.adapter_s3_endpoint,
                        cache_dir=Path(config.adapter_cache_dir), max_bytes=config.max_adapter_bytes,
                        timeout_s=min(SourceConfig.timeout_s, config.adapter_download_timeout),
                        deadline_s=config.adapter_download_timeout)


class Lifecycle:
    """Starts the engine in the background and holds the `Serving` once it is up."""

    def __init__(self, config: ServerConfig, engine_factory: Callable[[EngineConfig], object]) -> None:
        self.config = config
        self._factory = engine_factory
        self.serving: Serving | None = None
        self.failure: BaseException | None = None
        self.done = asyncio.Event()  # set when startup has finished, well or not

    def get_serving(self) -> Serving:
        if self.serving is None:
            reason = "failed to start; see the engine log" if self.failure else "is still starting"
            raise Unavailable(f"the engine {reason}", code="engine_not_ready")
        return self.serving

    async def start(self) -> None:
        try:
            self.serving = await self._start()
            log_event(log, "engine_ready", model=self.serving.model_name, max_model_len=self.serving.max_model_len)
        except Exception as exc:  # noqa: BLE001 - reported through /ready and the CLI's exit code
            self.failure = exc
            log_event(log, "engine_start_failed", logging.ERROR, error=f"{type(exc).__name__}: {exc}")
        finally:
            self.done.set()

    async def _start(self) -> Serving:
        loop = asyncio.get_running_loop()
        started = time.time()
        engine = await loop.run_in_executor(None, self._factory, self.config.engine)
        # Copied before the engine thread starts decoding with it.
        prompts = await loop.run_in_executor(None, PromptTokenizer, engine.tokenizer, engine.max_model_len)
        metrics = ServerMetrics(engine.model_name, self.config.engine.max_loras, engine.base_weights)
        async_engine = AsyncEngine(engine, metrics.observe_finished)
        async_engine.start()
        serving = Serving(async_engine, engine.adapters, prompts, engine.model_name, engine.max_model_len, metrics,
                          source_config(self.config), AdapterOps(), started, base_weights=engine.base_weights)
        try:
            for name, path in self.config.lora:
                await serving.adapter_ops.load(name, _load_startup_adapter, serving, name, path)
            # Each registered adapter shape's decode graphs, captured by the idle engine thread before /ready.
            missing = await async_engine.wait_for_graphs(GRAPH_CAPTURE_TIMEOUT_S)
        except BaseException:
            await self._stop(serving)
            raise
        if missing:
            log_event(log, "graphs_not_captured", logging.WARNING, missing=missing, timeout_s=GRAPH_CAPTURE_TIMEOUT_S)
        # What start-up made (the model's modules, tokenizers, imported libraries: a million objects and more)
        # lives as long as the process; frozen, full garbage collections no longer walk it, so one that starts on
        # the event loop takes milliseconds instead of a few hundred (seen: 0.27 s during a 15 MiB body).
        gc.freeze()
        return serving

    async def stop(self) -> None:
        if self.serving is not None:
            await self._stop(self.serving)

    @staticmethod
    async def _stop(serving: Serving) -> None:
        await serving.engine.stop()
        serving.adapter_ops.shutdown()
        serving.prompts.close()
        serving.engine.close()
        gc.unfreeze()  # start-up's objects go back to the collector (frozen ones would outlive the interpreter)


def _load_startup_adapter(serving: Serving, name: str, path: str) -> None:
    """Adapters named on the command line are trusted: local paths need no root (URLs still need a host)."""
    if name == serving.model_name:
        raise ValueError(f"--lora name {name!r} is the base model's served name")
    local = resolve_source(serving.sources, path).path if path.startswith(("http://", "https://", "s3://")) \
        else path
    info = serving.adapters.load(name, local)
    serving.remember_source(name, info.revision, path)  # before the loop serves any request
    log_event(log, "adapter_loaded", adapter=name, revision=info.revision, residency=info.tier,
              source=redact_source(path), source_digest=source_digest(path))


LIFECYCLE = web.AppKey("lifecycle", Lifecycle)
ADMIN_APP = web.AppKey("admin_app", web.Application)


async def health(request: web.Request) -> web.Response:
    lifecycle = request.app[LIFECYCLE]
    serving = lifecycle.serving
    if serving is not None and serving.engine.failure is not None:
        return web.json_response({"status": "engine_failed"}, status=503)
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    lifecycle = request.app[LIFECYCLE]
    if lifecycle.serving is not None and lifecycle.serving.engine.is_running:
        return web.json_response({"status": "ready"})
    status = "failed" if lifecycle.failure or lifecycle.serving else "starting"
    return web.json_response({"status": status}, status=503)


async def metrics(request: web.Request) -> web.Response:
    serving = request.app[LIFECYCLE].serving
    if serving is None:
        return web.Response(body=b"", content_type="text/plain")
    view = EngineView(serving.engine.snapshot(), [a for a in serving.adapters.list() if not a.is_unloading])
    return web.Response(body=serving.metrics.render(view), headers={"Content-Type": PROMETHEUS_TEXT})


def build_app(config: ServerConfig, engine_factory: Callable[[EngineConfig], object] = build_engine
              ) -> web.Application:
    """The serving application; it starts and stops the engine. Its admin application is `app[ADMIN_APP]`."""
    redact_aiohttp_logs()
    keys = KeyGate(config.require_api_keys)
    app = web.Application(middlewares=[*MIDDLEWARES, key_middleware(keys)], client_max_size=MAX_BODY_BYTES,
                          handler_args=HANDLER_ARGS)
    lifecycle = Lifecycle(config, engine_factory)
    app[LIFECYCLE] = lifecycle
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    OpenAIRoutes(lifecycle.get_serving).add_to(app)
    admin_routes = AdminRoutes(lifecycle.get_serving, config.admin_token, keys)
    admin_routes.add_public_to(app)
    ExtraRoutes(lifecycle.get_serving).add_to(app)
    app.cleanup_ctx.append(_engine_context)
    admin = web.Application(middlewares=[*MIDDLEWARES, admin_auth_middleware(config.admin_token)],
                            client_max_size=MAX_BODY_BYTES, handler_args=HANDLER_ARGS)
    admin[LIFECYCLE] = lifecycle
    admin[KEY_GATE] = keys
    admin_routes.add_to(admin)
    app[ADMIN_APP] = admin
    return app


async def _engine_context(app: web.Application):
    lifecycle = app[LIFECYCLE]
    task = asyncio.create_task(lifecycle.start())
    yield
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await lifecycle.stop()
