"""The router's aiohttp application: OpenAI inference routes, `/v1/models`, probes and metrics.

    POST /v1/completions, /v1/chat/completions  -> routing.route(model) -> proxy.forward
    GET  /v1/models                              -> the base model and the pool's adapters, from the placement
    GET  /health, /ready, /metrics
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from itertools import count

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kubelora.engine.common.errors import InvalidRequest, ModelNotFound, ServiceError, Unavailable
from kubelora.engine.common.http_errors import error_middleware, to_http
from kubelora.engine.router import routing
from kubelora.engine.router.config import RouterConfig
from kubelora.engine.router.metrics import RouterMetrics
from kubelora.engine.router.proxy import InFlight, forward
from kubelora.engine.router.sources import PlacementSource, PlacementStore

MAX_BODY_BYTES = 16 << 20  # the engine's own limit: a larger body would be refused there anyway
RETRY_AFTER_S = "1"


@dataclass
class RouterState:
    config: RouterConfig
    store: PlacementStore
    source: PlacementSource | None  # None when a test sets the store itself
    in_flight: InFlight = field(default_factory=InFlight)
    session: aiohttp.ClientSession | None = None
    requests_seen: count = field(default_factory=count)  # rotates ties between idle replicas
    metrics: RouterMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = RouterMetrics(lambda: (self.store.placement, self.in_flight.snapshot(), self.store.num_errors))


STATE = web.AppKey("router_state", RouterState)


def build_app(config: RouterConfig, store: PlacementStore, source: PlacementSource | None = None) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=MAX_BODY_BYTES)
    app[STATE] = RouterState(config, store, source)
    app.cleanup_ctx.append(_lifetime)
    app.router.add_post("/v1/completions", handle_inference)
    app.router.add_post("/v1/chat/completions", handle_inference)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/ready", handle_ready)
    app.router.add_get("/metrics", handle_metrics)
    return app


async def _lifetime(app: web.Application) -> AsyncIterator[None]:
    """One client session for all replicas (keep-alive), and the placement poller, for the app's lifetime."""
    state = app[STATE]
    # No total or read timeout: a long generation is not a failure. Connecting is bounded, so a dead replica is
    # passed over quickly.
    timeout = aiohttp.ClientTimeout(total=None, connect=state.config.connect_timeout,
                                    sock_connect=state.config.connect_timeout)
    state.session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False,
                                          connector=aiohttp.TCPConnector(limit=0))
    poller = asyncio.create_task(state.source.run(state.store)) if state.source is not None else None
    yield
    if poller is not None:
        poller.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await poller
    await state.session.close()


def _requested_model(body: bytes) -> str:
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise InvalidRequest("request body is not valid JSON", param=None, code="invalid_json") from None
    if not isinstance(payload, dict):
        raise InvalidRequest("request body must be a JSON object", param=None, code="invalid_type")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("field 'model' is required: the base model's name or an adapter of the pool",
                             param="model", code="missing_field")
    return model


def _route(state: RouterState, model: str) -> routing.Route:
    try:
        return routing.route(state.store.placement, model, state.in_flight.snapshot(), state.config.load_factor,
                             tiebreak=next(state.requests_seen))
    except routing.PlacementNotLoaded:
        raise Unavailable("the pool's placement is not loaded yet or lists no replica", code="placement_not_loaded",
                          headers={"Retry-After": RETRY_AFTER_S}) from None
    except routing.NoReadyReplica:
        raise Unavailable("no replica of the pool is ready", code="no_ready_replica",
                          headers={"Retry-After": RETRY_AFTER_S}) from None
    except routing.UnknownModel as exc:
        pool = state.store.placement.pool if state.store.placement else ""
        raise ModelNotFound(f"model {exc.model!r} does not exist in pool {pool!r}", param="model") from None


async def handle_inference(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    try:
        body = await request.read()
        model = _requested_model(body)
        route = _route(state, model)
    except ServiceError as exc:
        state.metrics.rejected.labels(to_http(exc).code).inc()
        raise
    state.metrics.requests.labels(model, route.candidates[0].pod, route.decision.value).inc()
    with state.metrics.duration.labels(route.decision.value).time():
        return await forward(request, body, route, state.session, state.in_flight, state.metrics)


async def handle_models(request: web.Request) -> web.Response:
    placement = request.app[STATE].store.placement
    if placement is None:
        raise Unavailable("the pool's placement is not loaded yet", code="placement_not_loaded",
                          headers={"Retry-After": RETRY_AFTER_S})
    created = int(request.app[STATE].store.loaded_at or 0)
    cards = [{"id": placement.base_model, "object": "model", "created": created, "owned_by": "kubelora",
              "root": placement.base_model, "parent": None}]
    cards += [{"id": name, "object": "model", "created": created, "owned_by": "kubelora", "root": name,
               "parent": placement.base_model, "replicas": list(placement.holders(name))}
              for name in sorted(placement.adapters)]
    return web.json_response({"object": "list", "data": cards})


async def handle_health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def handle_ready(request: web.Request) -> web.Response:
    placement = request.app[STATE].store.placement
    if placement is None:
        raise Unavailable("the pool's placement is not loaded yet", code="placement_not_loaded")
    if not placement.ready_replicas():
        raise Unavailable("no replica of the pool is ready", code="no_ready_replica")
    return web.json_response({"status": "ready", "revision": placement.revision,
                              "num_ready_replicas": len(placement.ready_replicas())})


async def handle_metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[STATE].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
