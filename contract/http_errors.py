"""HTTP answers in OpenAI's shape: one table from error class to status, and the one middleware that uses it.

Body: `{"error": {"message", "type", "param", "code"}}`. `type` is OpenAI's error type (clients and tests switch
on it); `code` refines it (the exception's own code, else the rule's, else the exception's stable `type`), so
clients can tell e.g. adapter_rank_too_large from adapter_shape_mismatch. Adapter load errors (adapter_load_error,
adapter_source_error) add `retryable`: true when the same load may succeed later unchanged (a source not there
yet, a network failure, HTTP 404/5xx), false when it fails the same way until the request or the files change
(corrupt files, shape or rank mismatch, a refused path or host); the operator retries only the former. No tracebacks leave the process: any
other exception is a bug, answered 500 with its traceback in the log only. `connection_error` is the body for what
never reaches the middleware (a request aiohttp's parser refuses; contract/aio_serve.py). The server and the router
both use it.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from aiohttp import web

from kubelora.contract.errors import (
    AdapterChanged, AdapterError, AdapterExists, AdapterSourceError, AdapterUnavailable, AdapterUnloading, BadGateway,
    EngineFault, InvalidRequest, ModelNotFound, PermissionDenied, PromptTooLong, QueueFull, RateLimited, RequestFailed,
    ServiceError, TooManyWatches, Unauthorized, Unavailable, UnknownAdapter)

log = logging.getLogger("kubelora.engine.http")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class HttpError:
    """One error response."""

    status: int
    type: str
    message: str
    param: str | None = None
    code: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    is_retryable: bool | None = None  # adapter load errors only (None: the body has no `retryable`)

    def body(self) -> dict:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        if self.is_retryable is not None:
            error["retryable"] = self.is_retryable
        return {"error": error}


@dataclass(frozen=True)
class HttpRule:
    status: int
    type: str  # OpenAI's error type
    param: str | None = None  # when the exception names no field
    code: str | None = None  # when the exception gives none (else its stable `type`)
    headers: Callable[[ServiceError], dict[str, str]] | None = None


def _retry_after(exc: QueueFull) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}


# The most derived class in an exception's MRO wins.
RULES: dict[type[ServiceError], HttpRule] = {
    ServiceError: HttpRule(400, "invalid_request_error"),
    InvalidRequest: HttpRule(400, "invalid_request_error"),
    PromptTooLong: HttpRule(413, "prompt_too_long", code="context_length_exceeded"),
    Unauthorized: HttpRule(401, "authentication_error", code="invalid_api_key"),
    PermissionDenied: HttpRule(403, "permission_error"),
    RateLimited: HttpRule(429, "rate_limit_error"),
    ModelNotFound: HttpRule(404, "not_found_error"),
    UnknownAdapter: HttpRule(404, "not_found_error", param="model", code="model_not_found"),
    AdapterUnloading: HttpRule(404, "not_found_error", param="model"),
    AdapterSourceError: HttpRule(400, "adapter_source_error"),
    AdapterError: HttpRule(400, "adapter_load_error", param="lora_path"),
    AdapterExists: HttpRule(409, "conflict_error", param="lora_name"),
    AdapterChanged: HttpRule(409, "conflict_error", param="lora_path"),
    QueueFull: HttpRule(429, "rate_limit_error", headers=_retry_after),
    TooManyWatches: HttpRule(429, "rate_limit_error"),
    Unavailable: HttpRule(503, "service_unavailable"),
    AdapterUnavailable: HttpRule(503, "adapter_unavailable", code="adapter_load_failed"),
    BadGateway: HttpRule(502, "upstream_error", code="replica_unreachable"),
    RequestFailed: HttpRule(422, "invalid_request_error"),
    EngineFault: HttpRule(500, "server_error"),
}
INTERNAL_ERROR = HttpError(500, "server_error", "internal server error; see the engine log")
# The connection handler's options for every app that takes tenant bodies: a compressed body is never inflated
# (refuse_encoded_bodies answers it 415 before reading it).
HANDLER_ARGS = {"auto_decompress": False}
# aiohttp's own errors (no route, wrong method, body too large) by status.
_AIOHTTP_TYPES = {404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large"}
# aiohttp's parser limits (RequestHandler's defaults, which no app here changes).
MAX_LINE_BYTES = 8190
MAX_HEADERS = 128
MALFORMED_REQUEST = HttpError(400, "invalid_request_error", "malformed HTTP request: its request line, a header or "
                              "the body's framing could not be parsed (a control character, a line over "
                              f"{MAX_LINE_BYTES} bytes, over {MAX_HEADERS} headers, a bad chunk size)",
                              code="malformed_request")


def to_http(exc: BaseException) -> HttpError | None:
    """The answer an exception stands for, or None when it is a bug."""
    if not isinstance(exc, ServiceError):
        return None
    rule = next(RULES[cls] for cls in type(exc).__mro__ if cls in RULES)
    headers = {**(rule.headers(exc) if rule.headers else {}), **exc.headers}
    param = exc.param if exc.param is not None else rule.param
    is_load_error = isinstance(exc, (AdapterError, AdapterSourceError))
    return HttpError(rule.status, rule.type, exc.message, param, exc.code or rule.code or exc.type, headers,
                     is_retryable=exc.is_transient if is_load_error else None)


def connection_error(status: int) -> HttpError:
    """The answer aiohttp's connection handler gives outside every middleware: a request its parser refused
    (4xx), a handler timeout or a failure past the error middleware (5xx). A fixed text, because the parser's
    own quotes the offending bytes, which may be an API key in a malformed `Authorization` header."""
    if status < 500:
        return MALFORMED_REQUEST if status == 400 else HttpError(status, "invalid_request_error",
                                                                 "malformed HTTP request", code="malformed_request")
    return INTERNAL_ERROR if status == 500 else HttpError(status, "server_error", "the server could not answer")


def error_response(error: HttpError) -> web.Response:
    return web.Response(status=error.status, text=json.dumps(error.body()), content_type="application/json",
                        headers=error.headers)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(HttpError(exc.status, _AIOHTTP_TYPES.get(exc.status, "invalid_request_error"),
                                        exc.reason or "error"))
    except Exception as exc:  # noqa: BLE001 - the one place every failure becomes a response
        error = to_http(exc)
        if error is None:
            log.exception("unhandled error on %s %s", request.method, request.path)
            error = INTERNAL_ERROR
        return error_response(error)


@web.middleware
async def refuse_encoded_bodies(request: web.Request, handler: Handler) -> web.StreamResponse:
    """415 for a body with a Content-Encoding other than identity, before any byte of it is read: no OpenAI
    client compresses requests, and inflating one on the event loop (1 MiB of gzip can hold 1 GiB) stalls it.
    Apps that use it run their connection handler with HANDLER_ARGS (auto_decompress off), so such a body is
    never inflated either way."""
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity") and request.body_exists:
        return error_response(HttpError(415, "invalid_request_error", "request bodies must not be compressed: "
                                        "'Content-Encoding' must be identity or absent", param=None,
                                        code="unsupported_content_encoding"))
    return await handler(request)
