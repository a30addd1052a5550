"""Typed engine errors. Each carries a stable `type` string that the HTTP edge maps to a status code.

Request errors are raised by `LLMEngine.add_request`; adapter errors by `AdapterManager.load` (and carried in
`RequestOutput.error` when an on-demand load fails). Messages name the adapter, the field and the limit.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose (anything else is a bug)."""

    type = "engine_error"


class InvalidRequest(EngineError, ValueError):
    """A malformed request: empty prompt, token id outside the vocabulary, duplicate request id."""

    type = "invalid_request"


class UnknownAdapter(EngineError, KeyError):
    """The request names an adapter that is not registered."""

    type = "unknown_adapter"

    def __init__(self, adapter: str) -> None:
        super().__init__(f"adapter {adapter!r} is not loaded")
        self.adapter = adapter

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class AdapterUnloading(EngineError):
    """The adapter is being unloaded: in-flight requests finish, new ones are refused."""

    type = "adapter_unloading"

    def __init__(self, adapter: str) -> None:
        super().__init__(f"adapter {adapter!r} is being unloaded; no new requests are admitted for it")
        self.adapter = adapter


class PromptTooLong(EngineError, ValueError):
    """The prompt does not leave room for one generated token within max_model_len."""

    type = "prompt_too_long"

    def __init__(self, num_prompt_tokens: int, max_model_len: int) -> None:
        super().__init__(
            f"prompt has {num_prompt_tokens} tokens; max_model_len is {max_model_len}, "
            f"so the prompt must have at most {max_model_len - 1} tokens"
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = max_model_len


class QueueFull(EngineError):
    """The waiting queue holds max_waiting requests already; retry later (HTTP 429)."""

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


class InvalidAdapter(AdapterError, ValueError):
    """The adapter files fail validation; `field` names what is wrong, `limit` what was allowed."""

    type = "invalid_adapter"

    def __init__(self, adapter: str, field: str, message: str, limit: object = None) -> None:
        super().__init__(adapter, f"{field}: {message}")
        self.field = field
        self.limit = limit


class AdapterNotFound(InvalidAdapter):
    """The adapter directory, its adapter_config.json or its adapter_model.safetensors is missing."""

    type = "adapter_not_found"


class AdapterCorrupt(InvalidAdapter):
    """adapter_config.json is not JSON, or the safetensors file cannot be parsed."""

    type = "adapter_corrupt"


class AdapterRankTooLarge(InvalidAdapter):
    type = "adapter_rank_too_large"


class AdapterTargetUnsupported(InvalidAdapter):
    """A target module the model does not have (or one the engine cannot adapt, e.g. lm_head)."""

    type = "adapter_target_unsupported"


class AdapterShapeMismatch(InvalidAdapter):
    type = "adapter_shape_mismatch"


class AdapterBaseModelMismatch(InvalidAdapter):
    type = "adapter_base_model_mismatch"


class AdapterTooLarge(InvalidAdapter):
    """The adapter alone needs more device pool rows than the pool has (max_lora_pool_bytes)."""

    type = "adapter_too_large"


class AdapterChanged(AdapterError):
    """An on-demand reload found different files than the registered revision (reload with load_inplace)."""

    type = "adapter_changed"
