"""Tenant API keys on the serving port: the engine is the last line behind the router.

With `--require-api-keys` every serving route but the probes, `/metrics` and `/version` needs
`Authorization: Bearer <key>` of a key in the table the operator pushes (`PUT /v1/api_keys` on the admin port:
digests only, kubelora.contract.keys). Until a table arrives such a pod answers 503 `api_keys_not_loaded` (the
operator pushes one to each engine it observes, before it routes to it). A completion or chat request for a model
its key may not call is 403 before the model is looked up, so the answer is the same whether or not it exists;
`/v1/models` lists what the key may call.

Requests already running when a key is revoked finish: the key is checked when a request arrives, and the
router does the same (docs/operator.md, "Tenant API keys").
"""

from __future__ import annotations

import logging

from aiohttp import web

from kubelora.contract.errors import InvalidRequest, Unavailable
from kubelora.contract.keys import OPEN, KeyGrant, KeyTable, parse_table
from kubelora.contract.logs import log_event

log = logging.getLogger("kubelora.engine.server")
OPEN_PATHS = frozenset(("/health", "/ready", "/metrics", "/version"))
GRANT = web.RequestKey("api_key_grant", object)  # the grant of the request's key (None: the pool is open)


class KeyGate:
    """The table the serving port enforces; replaced whole by the admin endpoint, read on the loop."""

    def __init__(self, is_required: bool) -> None:
        self.is_required = is_required
        self.table: KeyTable | None = None if is_required else OPEN  # None: required, none pushed yet

    def set(self, table: KeyTable) -> None:
        self.table = table

    def describe(self) -> dict:
        """For the operator's model list: whether keys are required and the fingerprint of the table held."""
        return {"required": self.is_required, "fingerprint": self.table.fingerprint() if self.table else None}

    def authorize(self, request: web.Request) -> KeyGrant | None:
        if self.table is None:
            raise Unavailable("this engine requires API keys and has not received its key table yet",
                              code="api_keys_not_loaded", headers={"Retry-After": "1"})
        return self.table.authorize(request.headers.getall("Authorization", []))


KEY_GATE = web.AppKey("key_gate", KeyGate)


def key_middleware(gate: KeyGate):
    """The serving port's gate: a request without a valid key is 401 before its body is read."""

    @web.middleware
    async def middleware(request: web.Request, handler):
        if request.path not in OPEN_PATHS:
            request[GRANT] = gate.authorize(request)
        return await handler(request)

    return middleware


def may_see(request: web.Request, model: str, base_model: str) -> bool:
    grant = request.get(GRANT)
    return grant is None or grant.may_call(model, base_model)


async def put_api_keys(request: web.Request) -> web.Response:
    """The admin port's `PUT /v1/api_keys` with `{"apiKeys": <table>}`: the whole table, replaced at once."""
    gate = request.app[KEY_GATE]
    try:
        body = await request.json()
    except ValueError:
        raise InvalidRequest("request body is not valid JSON", param=None, code="invalid_json") from None
    if not isinstance(body, dict) or "apiKeys" not in body:
        raise InvalidRequest("body must be {\"apiKeys\": {\"required\": ..., \"keys\": [...]}}", param="apiKeys",
                             code="missing_field")
    try:
        table = parse_table(body["apiKeys"])
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="apiKeys", code="invalid_value") from None
    if gate.is_required and not table.required:
        raise InvalidRequest("this engine runs with --require-api-keys: the table must require keys",
                             param="apiKeys.required", code="invalid_value")
    gate.set(table)
    log_event(log, "api_keys_set", num_keys=len(table.grants), fingerprint=table.fingerprint()[:12])
    return web.json_response(gate.describe())


async def get_api_keys(request: web.Request) -> web.Response:
    return web.json_response(request.app[KEY_GATE].describe())
