"""HTTP errors in OpenAI's shape, and the one middleware that maps exceptions onto them.

Body: `{"error": {"message", "type", "param", "code"}}`. `type` is stable (clients and tests switch on it);
`message` names the field and the limit. No tracebacks leave the process: a 5xx means a bug here, and its
traceback goes to the log only.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Awaitable, Callable

from aiohttp import web

from kubelora.engine import errors as engine_errors

log = logging.getLogger("kubelora.engine.server")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ApiError(Exception):
    """Base of every error the server answers on purpose. Subclasses fix status and type."""

    status = 400
    type = "invalid_request_error"
    default_code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.default_code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequest(ApiError):
    """400: malformed JSON, a wrong type, a missing field or a value out of range."""


class ContextLengthExceeded(ApiError):
    """400: prompt plus requested completion does not fit max-model-len."""

    default_code = "context_length_exceeded"


class PromptTooLong(ApiError):
    """413: the prompt alone does not fit max-model-len."""

    status = 413
    type = "prompt_too_long"
    default_code = "context_length_exceeded"


class Unauthorized(ApiError):
    status = 401
    type = "authentication_error"
    default_code = "invalid_api_key"


class ModelNotFound(ApiError):
    status = 404
    type = "not_found_error"
    default_code = "model_not_found"


class AdapterSourceError(ApiError):
    """400: an adapter path or URL refused (outside the roots, host not allowed) or unreadable."""

    type = "adapter_source_error"


class AdapterLoadError(ApiError):
    """400: the adapter itself is bad (rank too high, unknown targets, shapes, wrong base model)."""

    type = "adapter_load_error"


class AdapterConflict(ApiError):
    """409: a different revision under a loaded name without load_inplace, or a name being unloaded."""

    status = 409
    type = "conflict_error"


class Overloaded(ApiError):
    """429: the waiting queue is full; the client should retry after `Retry-After` seconds."""

    status = 429
    type = "rate_limit_error"
    default_code = "queue_full"

    def __init__(self, message: str, *, retry_after_s: int = 1, **kwargs) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_s)}, **kwargs)


class Unavailable(ApiError):
    """503: the engine is not ready or is shutting down."""

    status = 503
    type = "service_unavailable"


class InternalError(ApiError):
    status = 500
    type = "server_error"


def error_response(error: ApiError) -> web.Response:
    return web.Response(status=error.status, text=json.dumps(error.body()), content_type="application/json",
                        headers=error.headers)


def _from_http_exception(exc: web.HTTPException) -> ApiError:
    """aiohttp's own 404/405/413 (no route, wrong method, body too large) in the same JSON shape."""
    error = ApiError(exc.reason or "error", code=None)
    error.status = exc.status
    error.type = {404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large"}.get(
        exc.status, "invalid_request_error")
    return error


def _queue_full(exc: engine_errors.QueueFull) -> ApiError:
    return Overloaded(str(exc), retry_after_s=max(1, math.ceil(exc.retry_after_s)))


# Engine-core errors by class; the most derived class in an exception's MRO wins. `code` is the engine's
# own stable `type` string, so clients can tell e.g. adapter_rank_too_large from adapter_shape_mismatch.
_ENGINE_ERRORS: dict[type[BaseException], Callable[[BaseException], ApiError]] = {
    engine_errors.EngineError: lambda e: InvalidRequest(str(e), code=e.type),
    engine_errors.InvalidRequest: lambda e: InvalidRequest(str(e), param="prompt", code=e.type),
    engine_errors.UnknownAdapter: lambda e: ModelNotFound(f"model {e.adapter!r} does not exist", param="model"),
    engine_errors.AdapterUnloading: lambda e: ModelNotFound(str(e), param="model", code=e.type),
    engine_errors.PromptTooLong: lambda e: PromptTooLong(str(e), param="prompt"),
    engine_errors.QueueFull: _queue_full,
    engine_errors.AdapterError: lambda e: AdapterLoadError(str(e), param="lora_path", code=e.type),
    engine_errors.AdapterExists: lambda e: AdapterConflict(str(e), param="lora_name", code=e.type),
    engine_errors.AdapterChanged: lambda e: AdapterConflict(str(e), param="lora_path", code=e.type),
}


def translate(exc: BaseException) -> ApiError | None:
    """The ApiError an exception stands for, or None when it is a bug."""
    if isinstance(exc, ApiError):
        return exc
    for cls in type(exc).__mro__:
        if cls in _ENGINE_ERRORS:
            return _ENGINE_ERRORS[cls](exc)
    return None


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(_from_http_exception(exc))
    except Exception as exc:  # noqa: BLE001 - the one place every failure becomes a response
        error = translate(exc)
        if error is None:
            log.exception("unhandled error on %s %s", request.method, request.path)
            error = InternalError("internal server error; see the engine log")
        return error_response(error)
