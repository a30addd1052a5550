"""Typed requests, parsed and validated at the HTTP edge (OpenAI completions/chat, vLLM adapter admin).

Parsing checks types, ranges and unknown fields only; whether `model` exists and whether the prompt fits
max-model-len is decided later, by the handler that knows the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kubelora.engine.common.errors import InvalidRequest
from kubelora.engine.sampling_params import SamplingParams
from kubelora.engine.server.config import ADAPTER_NAME_RE
from kubelora.engine.server.fields import Fields

MAX_STOP_STRINGS = 16
MAX_PROMPTS = 64
MAX_SEED = 2**63 - 1
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

Prompt = str | tuple[int, ...]


@dataclass(frozen=True)
class Sampling:
    """The sampling fields completions and chat share; `max_tokens` None means until max-model-len."""

    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    skip_special_tokens: bool
    include_stop_str_in_output: bool

    def to_params(self, tag: str) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                              ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens,
                              include_stop_str_in_output=self.include_stop_str_in_output)


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompts: tuple[Prompt, ...]
    sampling: Sampling
    is_stream: bool
    include_usage: bool


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[ChatMessage, ...]
    sampling: Sampling
    is_stream: bool
    include_usage: bool
    add_generation_prompt: bool


MAX_AUTH_TOKEN_CHARS = 4096


@dataclass(frozen=True)
class LoadAdapterRequest:
    lora_name: str
    lora_path: str
    is_inplace: bool
    is_preload: bool
    sha256: str | None
    # kubelora extension: a bearer token for an http(s) source (from a Secret the operator reads); never
    # logged, never shown in cards.
    auth_token: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class UnloadAdapterRequest:
    lora_name: str


def _take_stop(f: Fields) -> tuple[str, ...]:
    value = f.take_any("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidRequest("'stop' must be a non-empty string or an array of non-empty strings", param="stop",
                             code="invalid_type")
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"'stop' has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed",
                             param="stop", code="out_of_range")
    return tuple(stops)


def _take_token_ids(f: Fields, key: str) -> tuple[int, ...]:
    ids = f.take_list(key) or []
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise InvalidRequest(f"'{key}' must be an array of non-negative integers", param=key, code="invalid_type")
    return tuple(ids)


def _take_sampling(f: Fields, max_tokens: int | None) -> Sampling:
    # vLLM spells "no top-k" as -1; the engine as 0.
    top_k = f.take_int("top_k", 0, low=-1)
    return Sampling(
        max_tokens=max_tokens,
        temperature=f.take_float("temperature", 1.0, low=0.0, high=2.0),
        top_p=f.take_float("top_p", 1.0, low=0.0, high=1.0, low_open=True),
        top_k=max(top_k, 0),
        seed=f.take_int("seed", None, low=-MAX_SEED - 1, high=MAX_SEED),
        stop=_take_stop(f),
        stop_token_ids=_take_token_ids(f, "stop_token_ids"),
        ignore_eos=f.take_bool("ignore_eos", False),
        skip_special_tokens=f.take_bool("skip_special_tokens", True),
        include_stop_str_in_output=f.take_bool("include_stop_str_in_output", False),
    )


def _take_common_unsupported(f: Fields) -> None:
    f.take_unsupported("n", 1)
    for key in ("presence_penalty", "frequency_penalty"):
        f.take_unsupported(key, 0, 0.0)
    f.take_unsupported("repetition_penalty", 1, 1.0)
    f.take_unsupported("logit_bias", {})
    f.take_str("user")


def _take_stream(f: Fields) -> tuple[bool, bool]:
    is_stream = f.take_bool("stream", False)
    options = f.take_object("stream_options")
    include_usage = False
    if options is not None:
        include_usage = options.take_bool("include_usage", False)
        options.take_bool("continuous_usage_stats", False)
        options.finish()
    return is_stream, include_usage


def _take_model(f: Fields) -> str:
    model = f.take_str("model", required=True)
    if not model:
        raise InvalidRequest("'model' must not be empty", param="model", code="invalid_value")
    return model


def _parse_prompts(value: Any) -> tuple[Prompt, ...]:
    """A string, an array of token ids, or an array of either (one choice per prompt)."""
    if isinstance(value, str) or (isinstance(value, list) and value and all(_is_token(t) for t in value)):
        prompts = [value]
    elif isinstance(value, list) and value:
        prompts = value
    else:
        raise InvalidRequest("'prompt' must be a non-empty string, an array of token ids, or an array of those",
                             param="prompt", code="invalid_type")
    if len(prompts) > MAX_PROMPTS:
        raise InvalidRequest(f"'prompt' has {len(prompts)} prompts; at most {MAX_PROMPTS} per request",
                             param="prompt", code="out_of_range")
    parsed: list[Prompt] = []
    for p in prompts:
        if isinstance(p, str) and p:
            parsed.append(p)
        elif isinstance(p, list) and p and all(_is_token(t) for t in p):
            parsed.append(tuple(p))
        else:
            raise InvalidRequest("'prompt' must not be empty: each prompt is a non-empty string or array of "
                                 "token ids", param="prompt", code="invalid_value")
    return tuple(parsed)


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_completion(body: dict[str, Any]) -> CompletionRequest:
    f = Fields(body)
    model = _take_model(f)
    prompts = _parse_prompts(f.take_any("prompt", required=True))
    sampling = _take_sampling(f, f.take_int("max_tokens", 16, low=1))
    is_stream, include_usage = _take_stream(f)
    _take_common_unsupported(f)
    f.take_unsupported("best_of", 1)
    f.take_unsupported("echo", False)
    f.take_unsupported("logprobs", 0)
    f.take_unsupported("suffix", "")
    f.finish()
    return CompletionRequest(model, prompts, sampling, is_stream, include_usage)


def _parse_content(value: Any, field: str) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, list):
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequest(f"'{field}[{i}]' must be {{\"type\": \"text\", \"text\": string}}; only text "
                                     "content is supported", param=f"{field}[{i}]", code="invalid_type")
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidRequest(f"'{field}' must be a string or an array of text parts", param=field, code="invalid_type")


def _parse_messages(value: list) -> tuple[ChatMessage, ...]:
    if not value:
        raise InvalidRequest("'messages' must not be empty", param="messages", code="invalid_value")
    messages = []
    for i, raw in enumerate(value):
        if not isinstance(raw, dict):
            raise InvalidRequest(f"'messages[{i}]' must be an object", param=f"messages[{i}]", code="invalid_type")
        f = Fields(raw, prefix=f"messages[{i}].")
        role = f.take_str("role", required=True)
        if role not in CHAT_ROLES:
            raise InvalidRequest(f"'messages[{i}].role' must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                                 param=f"messages[{i}].role", code="invalid_value")
        content = _parse_content(f.take_any("content", required=True), f"messages[{i}].content")
        f.take_str("name")
        f.finish()
        messages.append(ChatMessage(role, content))
    return tuple(messages)


def parse_chat(body: dict[str, Any]) -> ChatRequest:
    f = Fields(body)
    model = _take_model(f)
    messages = _parse_messages(f.take_list("messages", required=True))
    max_tokens = f.take_int("max_completion_tokens", None, low=1)
    legacy = f.take_int("max_tokens", None, low=1)
    sampling = _take_sampling(f, max_tokens if max_tokens is not None else legacy)
    is_stream, include_usage = _take_stream(f)
    _take_common_unsupported(f)
    f.take_unsupported("logprobs", False)
    f.take_unsupported("top_logprobs", 0)
    f.take_unsupported("tools", [])
    f.take_unsupported("tool_choice", "none")
    f.take_unsupported("response_format", {"type": "text"})
    f.take_bool("parallel_tool_calls", True)
    add_generation_prompt = f.take_bool("add_generation_prompt", True)
    f.finish()
    return ChatRequest(model, messages, sampling, is_stream, include_usage, add_generation_prompt)


def _take_adapter_name(f: Fields) -> str:
    name = f.take_str("lora_name", required=True)
    if not ADAPTER_NAME_RE.match(name):
        raise InvalidRequest(f"'lora_name' must match {ADAPTER_NAME_RE.pattern}, got {name!r}", param="lora_name",
                             code="invalid_value")
    return name


def parse_load_adapter(body: dict[str, Any]) -> LoadAdapterRequest:
    f = Fields(body)
    name = _take_adapter_name(f)
    path = f.take_str("lora_path", required=True)
    if not path:
        raise InvalidRequest("'lora_path' must not be empty", param="lora_path", code="invalid_value")
    sha256 = f.take_str("sha256")
    if sha256 is not None and (len(sha256) != 64 or any(c not in "0123456789abcdefABCDEF" for c in sha256)):
        raise InvalidRequest("'sha256' must be 64 hex digits", param="sha256", code="invalid_value")
    auth_token = f.take_str("auth_token")
    if auth_token is not None and not (0 < len(auth_token) <= MAX_AUTH_TOKEN_CHARS and auth_token.isprintable()):
        raise InvalidRequest(f"'auth_token' must be 1..{MAX_AUTH_TOKEN_CHARS} printable characters",
                             param="auth_token", code="invalid_value")
    request = LoadAdapterRequest(name, path, f.take_bool("load_inplace", False), f.take_bool("preload", True),
                                 sha256.lower() if sha256 else None, auth_token)
    f.take_any("lora_int_id")  # vLLM clients send it; ids are ours to assign
    f.finish()
    return request


def parse_unload_adapter(body: dict[str, Any]) -> UnloadAdapterRequest:
    f = Fields(body)
    name = _take_adapter_name(f)
    f.take_any("lora_int_id")
    f.finish()
    return UnloadAdapterRequest(name)
