"""The errors kubelora answers on purpose: one hierarchy for the engine core, the server and the router.

Each class has a stable `type`; an instance may name the field at fault (`param`) and refine `type` for clients
(`code`), and may carry response headers. Nothing here knows HTTP: `kubelora.contract.http_errors` maps each
class to its status in one table. Every class with an answer of its own lives here; refinements that share their
parent's answer stay beside the code that raises them (`kubelora.engine.errors`: each adapter validation failure).
Anything else that escapes a handler is a bug.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping


class FailureKind(enum.Enum):
    """Why the engine finished a request with finish_reason "error"; the server maps each to its answer."""

    ADAPTER_LOAD = "adapter_load"  # its adapter's on-demand load failed; a later request retries the load
    NON_FINITE_LOGITS = "non_finite_logits"  # its logits hold NaN or Inf: its adapter's weights or its input
    NO_TOKEN_LEFT = "no_token_left"  # its sampling parameters leave no token with a finite logit
    ENGINE_FAULT = "engine_fault"  # the engine's own work for it raised (a bug confined to this request)


class ServiceError(Exception):
    """Base of every error raised on purpose. `message` names the field and the limit.

    `is_transient`: the same request may succeed later without any change to it (a source not there yet, a
    network failure); False: it fails the same way until the request or the files change. A class says what its
    failures usually are; an instance may say otherwise (a download's HTTP 404 is transient, its size limit not).
    """

    type = "service_error"
    is_transient = False

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None, is_transient: bool | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        if is_transient is not None:
            self.is_transient = is_transient


# ---- the request as sent ----

class InvalidRequest(ServiceError, ValueError):
    """A request that cannot be served as sent.

    The server's parsers name the field and say why (`code`: invalid_json, invalid_type, out_of_range...).
    `LLMEngine.add_request` refuses an empty prompt, a token id outside the vocabulary or a duplicate request id
    with the message only: its checks are about the prompt, hence the default `param`.
    """

    type = "invalid_request"

    def __init__(self, message: str, *, param: str | None = "prompt", code: str | None = None) -> None:
        super().__init__(message, param=param, code=code)


class RequestFailed(ServiceError):
    """A valid request the engine could not finish, through no fault of the server: the model's logits for it
    are not finite (its adapter's weights or its input make the model diverge; `code` non_finite_logits) or its
    sampling parameters leave no token to sample (no_token_left). The same request fails the same way."""

    type = "request_failed"


class ContextLengthExceeded(InvalidRequest):
    """The prompt plus the requested completion does not fit max_model_len (the engine would clip it)."""

    type = "context_length_exceeded"


class PromptTooLong(ServiceError, ValueError):
    """The prompt does not leave room for one generated token within max_model_len."""

    type = "prompt_too_long"

    def __init__(self, num_prompt_tokens: int | None, max_model_len: int, *, param: str = "prompt",
                 message: str | None = None) -> None:
        """num_prompt_tokens: None when the prompt was refused before tokenizing (`message` says why)."""
        super().__init__(message or f"'{param}' has {num_prompt_tokens} tokens; max_model_len is {max_model_len}, "
                         f"so it may have at most {max_model_len - 1} tokens", param=param)
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = max_model_len


class ModelNotFound(ServiceError):
    """`model` names neither the base model nor an adapter that is served."""

    type = "model_not_found"


class Unauthorized(ServiceError):
    """An admin endpoint called without the bearer token it requires; a serving request without a valid API key
    where the pool requires one."""

    type = "unauthorized"


class PermissionDenied(ServiceError):
    """The request's API key may not call the model it names (whether or not that model exists)."""

    type = "permission_denied"


class RateLimited(ServiceError):
    """The request's API key is over its requests or tokens per minute; `retry_after_s` until it is not."""

    type = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message, param=None, code="rate_limit_exceeded",
                         headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))})


class AdapterSourceError(ServiceError):
    """An adapter path or URL refused (outside the roots, host not allowed: permanent) or unreadable (a missing
    path, a failed download: transient, see `ServiceError.is_transient`)."""

    type = "adapter_source_error"


# ---- the service's state ----

class Unavailable(ServiceError):
    """The engine is not ready or has stopped; the router has no placement or no ready replica."""

    type = "unavailable"


class TooManyWatches(ServiceError):
    """`GET /v1/models?changed_since=` while `max_watches` such waits are open already; retry later."""

    type = "too_many_watches"

    def __init__(self, max_watches: int) -> None:
        super().__init__(f"{max_watches} waits for adapter changes are open already (the most this server keeps); "
                         "retry later or list without changed_since", param="changed_since",
                         headers={"Retry-After": "5"})


class AdapterUnavailable(Unavailable):
    """The adapter's on-demand load failed; the next request for it retries the load."""

    type = "adapter_unavailable"


class EngineFault(ServiceError):
    """The engine's work for one request raised: a bug, confined to that request (the engine serves the others
    and goes on). The message names the exception's class; its text and traceback are in the engine log."""

    type = "engine_fault"


class BadGateway(ServiceError):
    """The router reached no replica, or a replica broke off its answer."""

    type = "bad_gateway"


# ---- raised by the engine core ----

class EngineError(ServiceError):
    """Base of the errors only the engine core raises (LLMEngine, AdapterManager)."""

    type = "engine_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)


class UnknownAdapter(EngineError, KeyError):
    """The request names an adapter that is not registered."""

    type = "unknown_adapter"

    def __init__(self, adapter: str) -> None:
        super().__init__(f"adapter {adapter!r} is not loaded")
        self.adapter = adapter

    def __str__(self) -> str:  # KeyError would quote the message
        return self.message


class AdapterUnloading(EngineError):
    """The adapter is being unloaded: in-flight requests finish, new ones are refused."""

    type = "adapter_unloading"

    def __init__(self, adapter: str) -> None:
        super().__init__(f"adapter {adapter!r} is being unloaded; no new requests are admitted for it")
        self.adapter = adapter


class QueueFull(EngineError):
    """The waiting queue holds max_waiting requests already; retry after `retry_after_s`."""

    type = "queue_full"

    def __init__(self, max_waiting: int, retry_after_s: float = 1.0) -> None:
        super().__init__(f"waiting queue is full (max_waiting={max_waiting}); retry after {retry_after_s:g}s")
        self.max_waiting = max_waiting
        self.retry_after_s = retry_after_s


class AdapterError(EngineError):
    """A failure of one adapter's load; it never affects other adapters or requests."""

    type = "adapter_error"

    def __init__(self, adapter: str, message: str) -> None:
        super().__init__(f"adapter {adapter!r}: {message}")
        self.adapter = adapter


class AdapterExists(AdapterError):
    """A different revision is already loaded under this name and load_inplace was not set."""

    type = "adapter_exists"


class AdapterChanged(AdapterError):
    """An on-demand reload found different files than the registered revision (reload with load_inplace)."""

    type = "adapter_changed"
