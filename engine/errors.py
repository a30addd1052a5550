"""The engine core's errors. Each carries a stable `type`; the server's error middleware gives its HTTP answer.

The classes with an answer of their own are defined once in `kubelora.contract.errors` (the server and the
router raise some of them too) and re-exported here. Request errors are raised by `LLMEngine.add_request`;
adapter errors by `AdapterManager.load` (and carried in `RequestOutput.error` when an on-demand load fails).
The adapter validation failures below share `AdapterError`'s answer. Messages name the adapter, the field and
the limit. All but AdapterNotFound are permanent (`is_transient` False): the same files fail the same way.
"""

from __future__ import annotations

from kubelora.contract.errors import (
    AdapterChanged,
    AdapterError,
    AdapterExists,
    AdapterUnloading,
    EngineError,
    InvalidRequest,
    PromptTooLong,
    QueueFull,
    UnknownAdapter,
)

__all__ = [
    "AdapterBaseModelMismatch", "AdapterChanged", "AdapterCorrupt", "AdapterError", "AdapterExists",
    "AdapterNotFound", "AdapterRankTooLarge", "AdapterShapeMismatch", "AdapterTargetUnsupported", "AdapterTooLarge",
    "AdapterUnloading", "EngineError", "InvalidAdapter", "InvalidRequest", "PromptTooLong", "QueueFull",
    "UnknownAdapter",
]


class InvalidAdapter(AdapterError, ValueError):
    """The adapter files fail validation; `field` names what is wrong, `limit` what was allowed."""

    type = "invalid_adapter"

    def __init__(self, adapter: str, field: str, message: str, limit: object = None) -> None:
        super().__init__(adapter, f"{field}: {message}")
        self.field = field
        self.limit = limit


class AdapterNotFound(InvalidAdapter):
    """The adapter directory, its adapter_config.json or its adapter_model.safetensors is missing.

    Transient: the files may still be on their way (a manifest applied before its artifact is copied)."""

    type = "adapter_not_found"
    is_transient = True


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
