"""The router's aiohttp application: OpenAI inference routes, `/v1/models`, probes and metrics.

    POST /v1/completions, /v1/chat/completions  -> key check -> routing.route(model, affinity key) -> proxy.forward
    GET  /v1/models                              -> the base model and the pool's adapters the key may call
    GET  /placement                              -> the revision routed on and its age (the operator's ack)
    GET  /health, /ready, /metrics
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from itertools import count

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kubelora.contract.errors import InvalidRequest, ModelNotFound, ServiceError, Unavailable
from kubelora.contract.http_errors import HANDLER_ARGS, error_middleware, refuse_encoded_bodies, to_http
from kubelora.contract.keys import KeyGrant, check_model, visible_models
from kubelora.contract.http_logs import redact_aiohttp_logs
from kubelora.contract.logs import log_event
from kubelora.router import routing
from kubelora.router.affinity import affinity_key
from kubelora.router.config import RouterConfig
from kubelora.router.limits import KeyLimits
from kubelora.router.placement import Placement
from kubelora.router.metrics import RouterMetrics, RouterSnapshot
from kubelora.router.proxy import InFlight, Unreachable, forward
from kubelora.router.sources import PlacementSource, PlacementStore

log = logging.getLogger("kubelora.router")
MAX_BODY_BYTES = 16 << 20  # the engine's own limit: a larger body would be refused there anyway
RETRY_AFTER_S = "1"
MAX_PLACEMENT_WAIT_S = 10.0  # GET /placement?wait=: the longest a caller may hold a request open


@dataclass
class RouterState:
    config: RouterConfig
    store: PlacementStore
    source: PlacementSource | None  # None when a test sets the store itself
    in_flight: InFlight = field(default_factory=InFlight)
    unreachable: Unreachable = field(default_factory=Unreachable)
    session: aiohttp.ClientSession | None = None
    requests_seen: count = field(default_factory=count)  # rotates ties between idle replicas
    is_stale: bool = False  # /ready last found the placement past --max-placement-age (logged on each change)
    limits: KeyLimits = field(default_factory=KeyLimits)
    metrics: RouterMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = RouterMetrics(lambda: RouterSnapshot(self.store.placement, self.in_flight.snapshot(),
                                                            self.store.num_errors, self.store.age_s()))


STATE = web.AppKey("router_state", RouterState)


def build_app(config: RouterConfig, store: PlacementStore, source: PlacementSource | None = None) -> web.Application:
    """The router's app, with the engine's HTTP edge: a compressed body is 415 and never inflated (the router
    reads every body to find its model), and aiohttp's parser errors are logged without the request's bytes
    (a malformed header may hold a tenant's API key, which the router passes on to the engines)."""
    redact_aiohttp_logs()
    # error_middleware outermost: the 415 gets its JSON body too.
    app = web.Application(middlewares=[error_middleware, refuse_encoded_bodies], client_max_size=MAX_BODY_BYTES,
                          handler_args=HANDLER_ARGS)
    app[STATE] = RouterState(config, store, source)
    app.cleanup_ctx.append(_lifetime)
    app.router.add_post("/v1/completions", handle_inference)
    app.router.add_post("/v1/chat/completions", handle_inference)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/placement", handle_placement)
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


def _parse_body(body: bytes) -> dict:
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise InvalidRequest("request body is not valid JSON", param=None, code="invalid_json") from None
    if not isinstance(payload, dict):
        raise InvalidRequest("request body must be a JSON object", param=None, code="invalid_type")
    return payload


def _requested_model(payload: dict) -> str:
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("field 'model' is required: the base model's name or an adapter of the pool",
                             param="model", code="missing_field")
    return model


def _placement(state: RouterState) -> Placement:
    placement = state.store.placement
    if placement is None:
        raise Unavailable("the pool's placement is not loaded yet", code="placement_not_loaded",
                          headers={"Retry-After": RETRY_AFTER_S})
    return placement


def _metric_model(placement: Placement, body: bytes) -> str:
    """The refused request's model as a metric label: a name the pool serves, else "other" (a label taken from
    any client's text would grow without bound). Never the key."""
    try:
        model = _parse_body(body).get("model")
    except InvalidRequest:
        model = None
    return model if model == placement.base_model or model in placement.adapters else "other"


def _route(state: RouterState, model: str, affinity: str | None) -> routing.Route:
    try:
        return routing.route(state.store.placement, model, state.in_flight.snapshot(), state.config.load_factor,
                             tiebreak=next(state.requests_seen), affinity=affinity)
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
    """The key is checked before the body is parsed (a 401 says nothing about the request), the model before
    routing (a 403 is the same whether or not the model exists), the key's rates last."""
    state = request.app[STATE]
    try:
        body = await request.read()
        placement = _placement(state)
        try:
            grant = placement.api_keys.authorize(request.headers.getall("Authorization", []))
            payload = _parse_body(body)
            model = _requested_model(payload)
            check_model(grant, model, placement.base_model)
            if grant is not None:
                state.limits.admit_request(grant, len(body), payload)
        except ServiceError as exc:
            if placement.api_keys.required and to_http(exc).status in (401, 403, 429):
                state.metrics.refuse_key(_metric_model(placement, body), to_http(exc).status)
            raise
        route = _route(state, model, affinity_key(model, payload, request.headers))
    except ServiceError as exc:
        state.metrics.rejected.labels(to_http(exc).code).inc()
        raise
    state.metrics.requests.labels(model, route.candidates[0].pod, route.decision.value).inc()
    with state.metrics.duration.labels(route.decision.value).time():
        return await forward(request, body, route, state.session, state.in_flight, state.metrics, state.unreachable)


async def handle_models(request: web.Request) -> web.Response:
    """The base model and the adapters the request's key may call (every one when the pool requires no key)."""
    state = request.app[STATE]
    placement = _placement(state)
    grant: KeyGrant | None = placement.api_keys.authorize(request.headers.getall("Authorization", []))
    created = int(state.store.loaded_at or 0)
    cards = []
    for name in visible_models(grant, [placement.base_model, *sorted(placement.adapters)], placement.base_model):
        card = {"id": name, "object": "model", "created": created, "owned_by": "kubelora", "root": name,
                "parent": None if name == placement.base_model else placement.base_model}
        if name != placement.base_model:
            card["replicas"] = list(placement.holders(name))
        cards.append(card)
    return web.json_response({"object": "list", "data": cards})


async def handle_health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def handle_ready(request: web.Request) -> web.Response:
    """503 until a placement with a ready replica is loaded, and once no read has confirmed it for
    --max-placement-age seconds. A shorter outage (an API-server restart) keeps the router in its Service: the
    placement it has still routes (a moved adapter is retried on a replica that loads it on demand)."""
    state = request.app[STATE]
    placement, age_s, max_age_s = state.store.placement, state.store.age_s(), state.config.max_placement_age
    if placement is None:
        raise Unavailable("the pool's placement is not loaded yet", code="placement_not_loaded")
    is_stale = bool(max_age_s) and age_s > max_age_s
    if is_stale != state.is_stale:
        state.is_stale = is_stale
        log_event(log, "placement_stale" if is_stale else "placement_fresh", logging.WARNING if is_stale else
                  logging.INFO, revision=placement.revision, age_s=round(age_s, 1), error=state.store.last_error)
    if is_stale:
        raise Unavailable(f"the placement (revision {placement.revision}) could not be read for {age_s:.0f} s, "
                          f"over --max-placement-age {max_age_s:g} s; last error: {state.store.last_error}",
                          code="placement_stale")
    if not placement.ready_replicas():
        raise Unavailable("no replica of the pool is ready", code="no_ready_replica")
    return web.json_response({"status": "ready", "revision": placement.revision,
                              "num_ready_replicas": len(placement.ready_replicas()),
                              "placement_age_seconds": round(age_s, 3)})


async def handle_placement(request: web.Request) -> web.Response:
    """The revision this router routes on, for the operator (its adapters are Ready once every ready router has
    taken a revision that includes them), and the requests it refused on their API key by model and status since
    it started (`keyRefusals`: the operator's events). `?min_revision=N&wait=S`: read the ConfigMap now (without
    `wait`: the read is started, the answer does not wait), and answer once the revision is at least N, a read
    fails, or S seconds (at most MAX_PLACEMENT_WAIT_S) have passed."""
    state = request.app[STATE]
    min_revision = _query_number(request, "min_revision", int, 0, 2**62)
    wait_s = _query_number(request, "wait", float, 0.0, MAX_PLACEMENT_WAIT_S) or 0.0
    store = state.store
    if min_revision is not None and _revision(store) < min_revision:
        store.nudge()
        deadline = asyncio.get_running_loop().time() + wait_s
        while True:  # at least the nudged read, so a router that just recovered answers its new revision
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0 or not await store.wait_read(left):
                break
            if _revision(store) >= min_revision or store.last_error is not None:
                break
    return web.json_response(placement_report(state))


def placement_report(state: RouterState) -> dict:
    store = state.store
    placement = store.placement
    refusals: dict[str, dict[str, int]] = {}  # model -> status -> requests refused on their key since start
    for (model, status), count in state.metrics.key_refusal_totals.items():
        if model != "other":
            refusals.setdefault(model, {})[status] = count
    return {"pool": placement.pool if placement else state.config.pool, "revision": _revision(store),
            "loadedAt": store.loaded_at, "ageSeconds": round(store.age_s(), 3), "lastError": store.last_error,
            "maxAgeSeconds": state.config.max_placement_age, "keyRefusals": refusals}


def _revision(store: PlacementStore) -> int:
    return store.placement.revision if store.placement is not None else -1


def _query_number(request: web.Request, name: str, kind: type, low: float, high: float):
    text = request.query.get(name)
    if text is None:
        return None
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise InvalidRequest(f"query parameter {name!r} must be a {kind.__name__} in [{low:g}, {high:g}], got "
                             f"{text!r}", param=name, code="invalid_value")
    return value


async def handle_metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[STATE].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
