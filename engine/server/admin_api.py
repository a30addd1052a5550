"""`GET /v1/models` and the vLLM adapter admin endpoints `POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`.

Loads resolve the source (confined path or allowed URL, downloaded) and read and validate the adapter in the
admin thread pool, never on the event loop and never in the engine step: requests keep flowing meanwhile.
Both admin endpoints are idempotent, and take `Authorization: Bearer <token>` when a token is configured.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from aiohttp import web

from kubelora.engine.common.errors import InvalidRequest, ModelNotFound, Unauthorized
from kubelora.engine.common.logs import log_event
from kubelora.engine.server.fields import decode_json_object
from kubelora.engine.server.protocol import LoadAdapterRequest, parse_load_adapter, parse_unload_adapter
from kubelora.engine.server.serving import Serving
from kubelora.engine.server.sources import resolve_source

if TYPE_CHECKING:  # the engine's public names; no import cost at runtime
    from kubelora.engine import AdapterInfo

log = logging.getLogger("kubelora.engine.server")


def model_card(serving: Serving, info: AdapterInfo) -> dict:
    requested = serving.requested_sources.get((info.name, info.revision))
    source, sha256 = (requested.lora_path, requested.sha256) if requested else (info.path, None)
    return {"id": info.name, "object": "model", "created": int(info.loaded_at), "owned_by": "kubelora",
            "root": info.path, "source": source, "sha256": sha256, "parent": serving.model_name,
            "revision": info.revision,
            "residency": info.tier, "rank": info.rank, "targets": list(info.targets),
            "is_loading": info.is_loading, "last_error": info.last_error}


def base_card(serving: Serving) -> dict:
    return {"id": serving.model_name, "object": "model", "created": int(serving.started_at), "owned_by": "kubelora",
            "root": serving.model_name, "parent": None, "max_model_len": serving.max_model_len}


def load_adapter(serving: Serving, req: LoadAdapterRequest) -> tuple[AdapterInfo, bool]:
    """Blocking: fetch or confine the source, then register (and stage) it. True when it was already there."""
    source = resolve_source(serving.sources, req.lora_path, req.sha256, auth_token=req.auth_token)
    before = serving.adapters.get(req.lora_name)
    info = serving.adapters.load(req.lora_name, source.path, load_inplace=req.is_inplace, preload=req.is_preload)
    is_same = before is not None and not before.is_unloading and before.revision == info.revision
    return info, is_same


class AdminRoutes:
    def __init__(self, get_serving: Callable[[], Serving], admin_token: str | None) -> None:
        self._serving = get_serving
        self._token = admin_token

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model_id:.+}", self.model)  # adapter names may hold '/'
        app.router.add_post("/v1/load_lora_adapter", self.load)
        app.router.add_post("/v1/unload_lora_adapter", self.unload)

    def _require_admin(self, request: web.Request) -> None:
        if self._token is None:
            return
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self._token.encode()):
            raise Unauthorized("this endpoint needs 'Authorization: Bearer <admin token>'",
                               headers={"WWW-Authenticate": "Bearer"})

    def model_cards(self, request: web.Request, serving: Serving) -> list[dict]:
        """The cards of every served model as this caller may see them (both model routes show these)."""
        cards = [base_card(serving)]
        cards += [model_card(serving, info) for info in serving.adapters.list() if not info.is_unloading]
        return cards

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": self.model_cards(request, self._serving())})

    async def model(self, request: web.Request) -> web.Response:
        """`GET /v1/models/{id}`: the base model's or one adapter's card; 404 model_not_found otherwise."""
        serving, model_id = self._serving(), request.match_info["model_id"]
        card = next((c for c in self.model_cards(request, serving) if c["id"] == model_id), None)
        if card is None:
            raise ModelNotFound(f"model {model_id!r} does not exist; GET /v1/models lists the served models",
                                param="model")
        return web.json_response(card)

    async def load(self, request: web.Request) -> web.Response:
        self._require_admin(request)
        serving = self._serving()
        req = parse_load_adapter(decode_json_object(await request.read()))
        if req.lora_name == serving.model_name:
            raise InvalidRequest(f"'lora_name' {req.lora_name!r} is the base model's name", param="lora_name",
                                 code="invalid_value")
        started = time.monotonic()
        try:
            info, is_same = await asyncio.get_running_loop().run_in_executor(serving.admin_pool, load_adapter,
                                                                             serving, req)
        except Exception as exc:
            log_event(log, "adapter_load_failed", logging.WARNING, adapter=req.lora_name, source=req.lora_path,
                      error=str(exc))
            raise
        seconds = time.monotonic() - started
        serving.remember_source(req.lora_name, info.revision, req.lora_path, req.sha256)
        if not is_same:
            serving.metrics.observe_load(req.lora_name, seconds)
        log_event(log, "adapter_loaded", adapter=req.lora_name, revision=info.revision, residency=info.tier,
                  source=req.lora_path, is_inplace=req.is_inplace, was_loaded=is_same, seconds=round(seconds, 4))
        verb = "was already loaded" if is_same else "added successfully"
        return web.json_response({"message": f"Success: LoRA adapter '{req.lora_name}' {verb}.",
                                  "was_loaded": is_same, "adapter": model_card(serving, info)})

    async def unload(self, request: web.Request) -> web.Response:
        self._require_admin(request)
        serving = self._serving()
        req = parse_unload_adapter(decode_json_object(await request.read()))
        if req.lora_name == serving.model_name:
            raise InvalidRequest("the base model cannot be unloaded", param="lora_name", code="invalid_value")
        # unload() waits for the name's lock, which a load of the same name holds while it reads files.
        was_loaded = await asyncio.get_running_loop().run_in_executor(serving.admin_pool, serving.adapters.unload,
                                                                      req.lora_name)
        serving.forget_source(req.lora_name)
        log_event(log, "adapter_unloaded", adapter=req.lora_name, was_loaded=was_loaded)
        verb = "removed successfully" if was_loaded else "was not loaded"
        return web.json_response({"message": f"Success: LoRA adapter '{req.lora_name}' {verb}.",
                                  "was_loaded": was_loaded})
