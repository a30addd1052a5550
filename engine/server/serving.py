"""What the handlers need once the engine runs: the engine bridge, its adapters, the prompt tokenizer, model
names and the length checks.

A `Serving` exists only after the engine has started; until then every engine-backed route answers 503.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kubelora.contract.errors import ContextLengthExceeded, ModelNotFound, PromptTooLong
from kubelora.contract.keys import KeyGrant, check_model
from kubelora.engine.server.adapter_ops import AdapterOps
from kubelora.engine.server.async_engine import AsyncEngine
from kubelora.engine.server.metrics import ServerMetrics
from kubelora.engine.server.sources import SourceConfig
from kubelora.engine.server.tokenization import PromptTokenizer

if TYPE_CHECKING:  # the engine's public names; no import cost at runtime
    from kubelora.engine import AdapterManager
    from kubelora.engine.model.quantized import BaseWeightsInfo


@dataclass(frozen=True)
class RequestedSource:
    lora_path: str  # as the load call wrote it
    sha256: str | None  # the digest the load was checked against, if one was given


@dataclass(frozen=True)
class Serving:
    engine: AsyncEngine
    adapters: AdapterManager  # the engine's (thread-safe); loads and unloads run through adapter_ops
    prompts: PromptTokenizer
    model_name: str  # the base model's served name
    max_model_len: int
    metrics: ServerMetrics
    sources: SourceConfig
    adapter_ops: AdapterOps  # adapter fetch + load, unload: blocking I/O, never on the loop
    started_at: float
    # (adapter name, revision) -> the lora_path it was loaded from, as the caller wrote it (a URL stays a URL),
    # and the sha256 it was checked against: the operator compares both with the source it wants.
    # Only touched on the event loop.
    requested_sources: dict[tuple[str, str], RequestedSource] = field(default_factory=dict)
    base_weights: BaseWeightsInfo | None = None  # the base's format and bytes as stored (None: not known)

    def remember_source(self, name: str, revision: str, source: str, sha256: str | None = None) -> None:
        for key in [k for k in self.requested_sources if k[0] == name]:
            del self.requested_sources[key]
        self.requested_sources[(name, revision)] = RequestedSource(source, sha256)

    def forget_source(self, name: str) -> None:
        for key in [k for k in self.requested_sources if k[0] == name]:
            del self.requested_sources[key]

    def resolve_model(self, model: str, grant: KeyGrant | None = None) -> str | None:
        """The adapter name to run (None for the base model); 403 when the request's API key (`grant`) may not
        call it, before it is looked up (the answer does not say whether it exists); 404 for a name nobody
        serves."""
        check_model(grant, model, self.model_name)
        if model == self.model_name:
            return None
        info = self.adapters.get(model)
        if info is None or info.is_unloading:
            raise ModelNotFound(f"model {model!r} does not exist; GET /v1/models lists the base model "
                                f"{self.model_name!r} and the loaded adapters", param="model")
        return model

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str) -> None:
        """PromptTooLong when the prompt alone leaves no room; ContextLengthExceeded when prompt + max_tokens
        does not fit max_model_len."""
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise PromptTooLong(num_prompt_tokens, limit, param=prompt_param)
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise ContextLengthExceeded(
                f"'max_tokens' is {max_tokens} and the prompt has {num_prompt_tokens} tokens: together more than "
                f"max-model-len ({limit}); at most {limit - num_prompt_tokens} tokens can be generated",
                param="max_tokens")
