"""What the handlers need once the engine runs: model names, tokenization, and the length checks.

A `Serving` exists only after the engine has started; until then every engine-backed route answers 503.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kubelora.engine.server.async_engine import AsyncEngine
from kubelora.engine.server.errors import ContextLengthExceeded, InvalidRequest, ModelNotFound, PromptTooLong
from kubelora.engine.server.metrics import ServerMetrics
from kubelora.engine.server.protocol import ChatMessage, Prompt
from kubelora.engine.server.sources import SourceConfig


@dataclass(frozen=True)
class RequestedSource:
    lora_path: str  # as the load call wrote it
    sha256: str | None  # the digest the load was checked against, if one was given

@dataclass(frozen=True)
class Serving:
    engine: AsyncEngine
    tokenizer: object  # the server's own HF tokenizer (the engine thread uses another instance)
    model_name: str  # the base model's served name
    max_model_len: int
    metrics: ServerMetrics
    sources: SourceConfig
    admin_pool: ThreadPoolExecutor  # adapter fetch + load: blocking I/O, never on the loop
    started_at: float
    # (adapter name, revision) -> the lora_path it was loaded from, as the caller wrote it (a URL stays a URL),
    # and the sha256 it was checked against: the operator compares both with the source it wants.
    # Only touched on the event loop.
    requested_sources: dict[tuple[str, str], RequestedSource] = field(default_factory=dict)

    @property
    def adapters(self):
        return self.engine.engine.adapters

    def remember_source(self, name: str, revision: str, source: str, sha256: str | None = None) -> None:
        for key in [k for k in self.requested_sources if k[0] == name]:
            del self.requested_sources[key]
        self.requested_sources[(name, revision)] = RequestedSource(source, sha256)

    def forget_source(self, name: str) -> None:
        for key in [k for k in self.requested_sources if k[0] == name]:
            del self.requested_sources[key]

    def resolve_model(self, model: str) -> str | None:
        """The adapter name to run (None for the base model); 404 for a name nobody serves."""
        if model == self.model_name:
            return None
        info = self.adapters.get(model)
        if info is None or info.is_unloading:
            raise ModelNotFound(f"model {model!r} does not exist; GET /v1/models lists the base model "
                                f"{self.model_name!r} and the loaded adapters", param="model")
        return model

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, tuple):
            return list(prompt)
        return list(self.tokenizer.encode(prompt))

    def render_chat(self, messages: tuple[ChatMessage, ...], add_generation_prompt: bool) -> list[int]:
        conversation = [{"role": m.role, "content": m.content} for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False)
        except Exception as exc:  # noqa: BLE001 - template errors (jinja raise_exception) are the caller's input
            raise InvalidRequest(f"'messages' cannot be rendered with the model's chat template: {exc}",
                                 param="messages", code="invalid_value") from None
        # The template writes special tokens (BOS) itself.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str) -> None:
        """413 when the prompt alone leaves no room; 400 when prompt + max_tokens exceeds max-model-len."""
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise PromptTooLong(f"'{prompt_param}' has {num_prompt_tokens} tokens; max-model-len is {limit}, so "
                                f"a prompt may have at most {limit - 1} tokens", param=prompt_param)
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise ContextLengthExceeded(
                f"'max_tokens' is {max_tokens} and the prompt has {num_prompt_tokens} tokens: together more than "
                f"max-model-len ({limit}); at most {limit - num_prompt_tokens} tokens can be generated",
                param="max_tokens")
