"""The model list and the vLLM adapter admin endpoints `POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`.

Two route sets over one engine. The serving port gets only the public model list (`GET /v1/models`, sources
redacted, no long poll); the admin port (`--admin-port`) gets the full list with its long poll and the load and
unload endpoints, and, when a token is configured, answers nothing without `Authorization: Bearer <token>`
(`admin_auth_middleware`). Loads resolve the source (confined path or allowed URL, downloaded) and read and
validate the adapter in the admin thread pool, never on the event loop and never in the engine step: requests
keep flowing meanwhile. Both admin endpoints are idempotent.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from aiohttp import web

from kubelora.contract.errors import InvalidRequest, ModelNotFound, Unauthorized
from kubelora.contract.load import LoadRequest
from kubelora.contract.logs import log_event
from kubelora.engine.server.api_keys import GRANT, KeyGate, get_api_keys, may_see, put_api_keys
from kubelora.engine.server.fields import parse_body
from kubelora.engine.server.models_watch import ModelsWatch, adapter_set_tag, parse_wait_s
from kubelora.engine.server.protocol import parse_load_adapter, parse_unload_adapter
from kubelora.engine.server.serving import Serving
from kubelora.engine.server.source_text import redact_source, source_digest
from kubelora.engine.server.sources import resolve_source

if TYPE_CHECKING:  # the engine's public names; no import cost at runtime
    from kubelora.engine import AdapterInfo

log = logging.getLogger("kubelora.engine.server")


def model_card(serving: Serving, info: AdapterInfo, *, is_admin: bool) -> dict:
    """The adapter's card. Without the admin token, its source is redacted (no credentials, no query string)
    and the local directory the engine reads is not shown; `source_digest` identifies the full source for
    every caller, so the operator can compare sources without the token."""
    requested = serving.requested_sources.get((info.name, info.revision))
    source, sha256 = (requested.lora_path, requested.sha256) if requested else (info.path, None)
    shown = source if is_admin else redact_source(source)
    return {"id": info.name, "object": "model", "created": int(info.loaded_at), "owned_by": "kubelora",
            "root": info.path if is_admin else shown, "source": shown, "source_digest": source_digest(source),
            "sha256": sha256, "parent": serving.model_name, "revision": info.revision,
            "residency": info.tier, "rank": info.rank, "targets": list(info.targets), "bytes": info.bytes,
            "is_loading": info.is_loading, "last_error": info.last_error}


def base_card(serving: Serving) -> dict:
    """The base model's card; `adapter_pool_bytes` is the room the device adapter pool guarantees: every set of
    adapters whose `bytes` sum to at most it can be resident at once. `adapter_module_bytes` is how an adapter's
    `bytes` are counted, per module (per_rank x its rank + fixed, + dora with DoRA), for placing an adapter before
    the engine has read it. `format` is the base weights' ("bfloat16", or an FP8 scheme such as
    "fp8-channel-dynamic-token"), `weight_bytes` their bytes as stored."""
    card = {"id": serving.model_name, "object": "model", "created": int(serving.started_at), "owned_by": "kubelora",
            "root": serving.model_name, "parent": None, "max_model_len": serving.max_model_len,
            "adapter_pool_bytes": serving.adapters.stats().pool_total_bytes,
            "adapter_module_bytes": serving.adapters.module_costs()}
    if serving.base_weights is not None:
        card.update(format=serving.base_weights.format, weight_bytes=serving.base_weights.bytes)
    return card


def load_adapter(serving: Serving, req: LoadRequest) -> tuple[AdapterInfo, bool]:
    """Blocking: fetch or confine the source, then register (and stage) it. True when it was already there."""
    source = resolve_source(serving.sources, req.lora_path, req.sha256, auth_token=req.auth_token,
                            s3=req.s3)
    before = serving.adapters.get(req.lora_name)
    info = serving.adapters.load(req.lora_name, source.path, load_inplace=req.is_inplace, preload=req.is_preload)
    is_same = before is not None and not before.is_unloading and before.revision == info.revision
    return info, is_same


def has_admin_token(request: web.Request, token: str | None) -> bool:
    """The request carries the configured token (constant-time compare); always False when none is configured."""
    if token is None:
        return False
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    try:
        # aiohttp hands header bytes that are not UTF-8 over as surrogate escapes.
        given_bytes = given.strip().encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return False
    return scheme.lower() == "bearer" and hmac.compare_digest(given_bytes, token.encode())


def admin_auth_middleware(token: str | None):
    """The admin port's gate: with a token configured, every request without it is a 401 (before routing, so
    even an unknown path tells nothing). Without one the port is open: docs/server.md says who may reach it."""

    @web.middleware
    async def middleware(request: web.Request, handler):
        if token is not None and not has_admin_token(request, token):
            raise Unauthorized("the admin port needs 'Authorization: Bearer <admin token>'",
                               headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return middleware


class AdminRoutes:
    def __init__(self, get_serving: Callable[[], Serving], admin_token: str | None, keys: KeyGate) -> None:
        self._serving = get_serving
        self._token = admin_token
        self._keys = keys
        self._watch = ModelsWatch()

    def add_public_to(self, app: web.Application) -> None:
        """The serving port's share: the model list, always redacted."""
        app.router.add_get("/v1/models", self.public_models)
        app.router.add_get("/v1/models/{model_id:.+}", self.public_model)  # adapter names may hold '/'

    def add_to(self, app: web.Application) -> None:
        """The admin port's routes (behind admin_auth_middleware)."""
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model_id:.+}", self.model)
        app.router.add_post("/v1/load_lora_adapter", self.load)
        app.router.add_post("/v1/unload_lora_adapter", self.unload)
        app.router.add_put("/v1/api_keys", put_api_keys)
        app.router.add_get("/v1/api_keys", get_api_keys)

    def _has_admin_token(self, request: web.Request) -> bool:
        return has_admin_token(request, self._token)

    @staticmethod
    def model_cards(serving: Serving, is_admin: bool) -> list[dict]:
        """The cards of every served model; full ones only for a caller with the admin token."""
        cards = [base_card(serving)]
        cards += [model_card(serving, info, is_admin=is_admin) for info in serving.adapters.list()
                  if not info.is_unloading]
        return cards

    async def public_models(self, request: web.Request) -> web.Response:
        if request.query.get("changed_since") is not None:
            raise InvalidRequest("waiting for a change ('changed_since') is served on the admin port only",
                                 param="changed_since", code="invalid_value")
        return self._list(self._serving(), is_admin=False, request=request)

    async def public_model(self, request: web.Request) -> web.Response:
        serving, model_id = self._serving(), request.match_info["model_id"]
        serving.resolve_model(model_id, request.get(GRANT))  # 403 for a model the key may not call
        return self._card(serving, model_id, is_admin=False)

    async def models(self, request: web.Request) -> web.Response:
        """The served models, tagged (`ETag`) by the adapter set; `?changed_since=<tag>[&wait_s=<s>]` waits until
        the set differs from that tag (models_watch.py)."""
        since = request.query.get("changed_since")
        if since is not None:
            await self._watch.wait_for_change(self._serving, since, parse_wait_s(request.query.get("wait_s")))
        return self._list(self._serving(), is_admin=self._has_admin_token(request))

    async def model(self, request: web.Request) -> web.Response:
        return self._card(self._serving(), request.match_info["model_id"], is_admin=self._has_admin_token(request))

    def _list(self, serving: Serving, is_admin: bool, request: web.Request | None = None) -> web.Response:
        """On the serving port (`request` given) only what the request's API key may call; on the admin port the
        base card also says which API key table the engine holds (`api_keys`: the operator pushes one that
        differs), and each adapter's card its `tokens_served` (prompt and generated tokens of its finished
        requests since the engine started: the operator's demand measure)."""
        cards = self.model_cards(serving, is_admin)
        if request is None:
            cards[0]["api_keys"] = self._keys.describe()
            for card in cards[1:]:  # each adapter's demand, for the operator (not shown to tenants)
                card["tokens_served"] = serving.metrics.tokens_served.get(card["id"], 0)
        else:
            cards = [c for c in cards if may_see(request, c["id"], serving.model_name)]
        return web.json_response({"object": "list", "data": cards}, headers={"ETag": f'"{adapter_set_tag(serving)}"'})

    def _card(self, serving: Serving, model_id: str, is_admin: bool) -> web.Response:
        """`GET /v1/models/{id}`: the base model's or one adapter's card; 404 model_not_found otherwise."""
        card = next((c for c in self.model_cards(serving, is_admin) if c["id"] == model_id), None)
        if card is None:
            raise ModelNotFound(f"model {model_id!r} does not exist; GET /v1/models lists the served models",
                                param="model")
        return web.json_response(card)

    async def load(self, request: web.Request) -> web.Response:
        serving = self._serving()
        req = await parse_body(request, parse_load_adapter)
        if req.lora_name == serving.model_name:
            raise InvalidRequest(f"'lora_name' {req.lora_name!r} is the base model's name", param="lora_name",
                                 code="invalid_value")
        task = serving.adapter_ops.load(req.lora_name, load_adapter, serving, req)
        task.add_done_callback(functools.partial(_finish_load, serving, req, time.monotonic()))
        info, is_same = await asyncio.shield(task)  # a client that leaves does not cancel the load
        verb = "was already loaded" if is_same else "added successfully"
        return web.json_response({"message": f"Success: LoRA adapter '{req.lora_name}' {verb}.",
                                  "was_loaded": is_same,
                                  "adapter": model_card(serving, info, is_admin=self._has_admin_token(request))})

    async def unload(self, request: web.Request) -> web.Response:
        serving = self._serving()
        req = await parse_body(request, parse_unload_adapter)
        if req.lora_name == serving.model_name:
            raise InvalidRequest("the base model cannot be unloaded", param="lora_name", code="invalid_value")
        # unload() waits for the name's lock, which a load of the same name holds while it reads files: the
        # operation waits for that load, and only for operations on this name.
        task = serving.adapter_ops.unload(req.lora_name, serving.adapters.unload, req.lora_name)
        task.add_done_callback(functools.partial(_finish_unload, serving, req.lora_name))
        was_loaded = await asyncio.shield(task)
        verb = "removed successfully" if was_loaded else "was not loaded"
        return web.json_response({"message": f"Success: LoRA adapter '{req.lora_name}' {verb}.",
                                  "was_loaded": was_loaded})


def _finish_load(serving: Serving, req: LoadRequest, started: float, task: asyncio.Task) -> None:
    """On the loop, whether or not the client still waits: record the source, observe and log the outcome."""
    source = {"source": redact_source(req.lora_path), "source_digest": source_digest(req.lora_path)}
    seconds = round(time.monotonic() - started, 4)
    error = None if task.cancelled() else task.exception()
    if task.cancelled() or error is not None:
        reason = "cancelled (server shutting down)" if task.cancelled() else f"{type(error).__name__}: {error}"
        log_event(log, "adapter_load_failed", logging.WARNING, adapter=req.lora_name, **source, error=reason,
                  seconds=seconds)
        return
    info, is_same = task.result()
    serving.remember_source(req.lora_name, info.revision, req.lora_path, req.sha256)
    if not is_same:
        serving.metrics.observe_load(req.lora_name, seconds)
    log_event(log, "adapter_loaded", adapter=req.lora_name, revision=info.revision, residency=info.tier, **source,
              is_inplace=req.is_inplace, was_loaded=is_same, seconds=seconds)


def _finish_unload(serving: Serving, name: str, task: asyncio.Task) -> None:
    if task.cancelled() or task.exception() is not None:
        reason = "cancelled" if task.cancelled() else f"{type(task.exception()).__name__}: {task.exception()}"
        log_event(log, "adapter_unload_failed", logging.WARNING, adapter=name, error=reason)
        return
    serving.forget_source(name)
    log_event(log, "adapter_unloaded", adapter=name, was_loaded=task.result())
