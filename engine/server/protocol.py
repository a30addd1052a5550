"""Typed requests, parsed and validated at the HTTP edge (OpenAI completions/chat, vLLM adapter admin).

Parsing checks types, ranges and unknown fields only; whether `model` exists and whether the prompt fits
max-model-len is decided later, by the handler that knows the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from kubelora.contract.errors import InvalidRequest
from kubelora.contract.load import S3_FIELDS, LoadRequest, S3Access
from kubelora.engine.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams
from kubelora.engine.server.config import ADAPTER_NAME_RULE, is_valid_adapter_name
from kubelora.engine.server.chat_template import TemplateOptions, take_template_options
from kubelora.engine.server.fields import Fields, check_text
from kubelora.engine.server.structured import take_structured
from kubelora.engine.structured import StructuredOutput
from kubelora.engine.server.tools import take_message_tool_fields, take_tools

# What one request may carry (docs/server.md, "Request limits"): every list the engine walks per step or the
# tokenizer thread encodes is bounded, so that one request cannot hold the others up.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # per stop string: each is searched for in the tail of the text at every step
MAX_PROMPTS = 64
MAX_SEED = 2**63 - 1
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 256  # per word: each is tokenized twice on the one tokenizer thread
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_ALLOWED_TOKEN_IDS = 65536
MAX_MESSAGES = 4096  # the chat template renders each one on the tokenizer thread
MAX_CACHE_SALT_CHARS = 1024
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
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()  # tokenized by the handler (`to_params`'s bad_words_token_ids)
    logprobs: int | None = None  # top log-probabilities per generated token (None: no logprobs)
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None  # response_format / structured_outputs / guided_* (structured.py)

    def to_params(self, bad_words_token_ids: tuple[tuple[int, ...], ...] = ()) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                              ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens,
                              include_stop_str_in_output=self.include_stop_str_in_output, min_p=self.min_p,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias,
                              min_tokens=self.min_tokens, allowed_token_ids=self.allowed_token_ids,
                              bad_words_token_ids=bad_words_token_ids, logprobs=self.logprobs,
                              prompt_logprobs=self.prompt_logprobs, structured=self.structured)


@dataclass(frozen=True)
class Choices:
    """How one request's prompts become choices: n per prompt (choice index prompt * n + j), echo, truncation,
    and the usage reporting of a stream."""

    n: int = 1
    echo: bool = False  # completions: the prompt's text (and logprobs) before the completion
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens; -1: the last max-model-len - 1
    continuous_usage_stats: bool = False  # every stream chunk carries its choice's usage so far


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompts: tuple[Prompt, ...]
    sampling: Sampling
    is_stream: bool
    include_usage: bool
    choices: Choices = Choices()
    cache_salt: str | None = None  # vLLM: cached KV blocks are shared only among requests of the same salt


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    name: str | None = None
    tool_calls: tuple[dict, ...] = ()  # assistant: the calls it made (tools.py's template shape)
    tool_call_id: str | None = None  # tool: the call this message answers


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[ChatMessage, ...]
    sampling: Sampling
    is_stream: bool
    include_usage: bool
    add_generation_prompt: bool
    choices: Choices = Choices()
    template: TemplateOptions = TemplateOptions()  # tools, continue_final_message, chat_template_kwargs
    cache_salt: str | None = None  # as CompletionRequest's


MAX_AUTH_TOKEN_CHARS = 4096


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
    _check_lengths(stops, "stop", MAX_STOP_CHARS)
    return tuple(check_text(s, "stop") for s in stops)


def _check_lengths(texts: list[str], key: str, max_chars: int) -> None:
    longest = max((len(t) for t in texts), default=0)
    if longest > max_chars:
        raise InvalidRequest(f"'{key}' holds a string of {longest} characters; at most {max_chars} are allowed",
                             param=key, code="out_of_range")


def _take_token_ids(f: Fields, key: str, max_ids: int, ids: list | None = None) -> tuple[int, ...]:
    ids = (f.take_list(key) or []) if ids is None else ids
    if len(ids) > max_ids:
        raise InvalidRequest(f"'{key}' has {len(ids)} token ids; at most {max_ids} are allowed", param=key,
                             code="out_of_range")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise InvalidRequest(f"'{key}' must be an array of non-negative integers", param=key, code="invalid_type")
    return tuple(ids)


def _take_logit_bias(f: Fields) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"<token id>": bias in [-100, 100]}."""
    raw = f.take_any("logit_bias")
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise InvalidRequest("'logit_bias' must be an object of token id -> number", param="logit_bias",
                             code="invalid_type")
    if len(raw) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequest(f"'logit_bias' has {len(raw)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed",
                             param="logit_bias", code="out_of_range")
    entries = []
    for key, value in raw.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 12):
            raise InvalidRequest(f"'logit_bias' keys must be token ids (decimal integers), got {key!r}",
                                 param="logit_bias", code="invalid_value")
        entries.append((int(key), Fields(raw, prefix="logit_bias.").take_float(key, 0.0, low=-MAX_LOGIT_BIAS,
                                                                                high=MAX_LOGIT_BIAS)))
    return tuple(entries)


def _take_words(f: Fields, key: str) -> tuple[str, ...]:
    words = f.take_list(key) or []
    if not all(isinstance(w, str) and w.strip() for w in words):
        raise InvalidRequest(f"'{key}' must be an array of non-blank strings", param=key, code="invalid_type")
    if len(words) > MAX_BAD_WORDS:
        raise InvalidRequest(f"'{key}' has {len(words)} strings; at most {MAX_BAD_WORDS} are allowed", param=key,
                             code="out_of_range")
    _check_lengths(words, key, MAX_BAD_WORD_CHARS)
    return tuple(check_text(w, key) for w in words)


def _take_processing(f: Fields, sampling: Sampling) -> Sampling:
    """Penalties, logit bias, min_p, min_tokens and token constraints (vLLM's names and ranges)."""
    allowed = f.take_list("allowed_token_ids")
    if allowed is not None and not allowed:
        raise InvalidRequest("'allowed_token_ids' must not be empty", param="allowed_token_ids",
                             code="invalid_value")
    allowed = None if allowed is None else _take_token_ids(f, "allowed_token_ids", MAX_ALLOWED_TOKEN_IDS, allowed)
    min_tokens = f.take_int("min_tokens", 0, low=0)
    if sampling.max_tokens is not None and min_tokens > sampling.max_tokens:
        raise InvalidRequest(f"'min_tokens' ({min_tokens}) must not exceed 'max_tokens' ({sampling.max_tokens})",
                             param="min_tokens", code="out_of_range")
    return replace(
        sampling,
        min_p=f.take_float("min_p", 0.0, low=0.0, high=1.0),
        presence_penalty=f.take_float("presence_penalty", 0.0, low=-2.0, high=2.0),
        frequency_penalty=f.take_float("frequency_penalty", 0.0, low=-2.0, high=2.0),
        repetition_penalty=f.take_float("repetition_penalty", 1.0, low=0.0, high=2.0, low_open=True),
        logit_bias=_take_logit_bias(f),
        min_tokens=min_tokens,
        allowed_token_ids=allowed,
        bad_words=_take_words(f, "bad_words"),
        prompt_logprobs=f.take_int("prompt_logprobs", None, low=0, high=MAX_LOGPROBS),
    )


def _take_choices(f: Fields, num_prompts: int, continuous_usage_stats: bool, echo: bool = False) -> Choices:
    n = f.take_int("n", 1, low=1, high=MAX_PROMPTS)
    if num_prompts * n > MAX_PROMPTS:
        raise InvalidRequest(f"{num_prompts} prompts x 'n' {n} is {num_prompts * n} choices; at most {MAX_PROMPTS} "
                             "per request", param="n", code="out_of_range")
    truncate = f.take_int("truncate_prompt_tokens", None, low=-1)
    if truncate == 0:
        raise InvalidRequest("'truncate_prompt_tokens' must be >= 1 or -1 (max-model-len), got 0",
                             param="truncate_prompt_tokens", code="out_of_range")
    return Choices(n=n, echo=echo, truncate_prompt_tokens=truncate, continuous_usage_stats=continuous_usage_stats)


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
        stop_token_ids=_take_token_ids(f, "stop_token_ids", MAX_STOP_TOKEN_IDS),
        ignore_eos=f.take_bool("ignore_eos", False),
        skip_special_tokens=f.take_bool("skip_special_tokens", True),
        include_stop_str_in_output=f.take_bool("include_stop_str_in_output", False),
    )


def _take_common_unsupported(f: Fields) -> None:
    f.take_str("user")


def _take_cache_salt(f: Fields) -> str | None:
    salt = f.take_str("cache_salt")
    if salt == "":
        raise InvalidRequest("'cache_salt' must not be empty", param="cache_salt", code="invalid_value")
    if salt is not None and len(salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequest(f"'cache_salt' has {len(salt)} characters; at most {MAX_CACHE_SALT_CHARS} are allowed",
                             param="cache_salt", code="out_of_range")
    return salt


def _take_stream(f: Fields) -> tuple[bool, bool, bool]:
    """stream, include_usage, continuous_usage_stats (vLLM: only with include_usage)."""
    is_stream = f.take_bool("stream", False)
    options = f.take_object("stream_options")
    include_usage = continuous = False
    if options is not None:
        include_usage = options.take_bool("include_usage", False)
        continuous = options.take_bool("continuous_usage_stats", False) and include_usage
        options.finish()
    return is_stream, include_usage, continuous


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
            parsed.append(check_text(p, "prompt"))
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
    sampling = _take_processing(f, _take_sampling(f, f.take_int("max_tokens", 16, low=1)))
    is_stream, include_usage, continuous = _take_stream(f)
    _take_common_unsupported(f)
    f.take_unsupported("best_of", 1)
    echo = f.take_bool("echo", False)
    logprobs = f.take_int("logprobs", None, low=0, high=MAX_LOGPROBS)
    prompt_logprobs = sampling.prompt_logprobs
    if echo and logprobs is not None:  # echo with logprobs returns the prompt tokens' logprobs first
        prompt_logprobs = max(prompt_logprobs or 0, logprobs)
    sampling = replace(sampling, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    choices = _take_choices(f, len(prompts), continuous, echo)
    f.take_unsupported("suffix", "")
    sampling = replace(sampling, structured=take_structured(f))
    cache_salt = _take_cache_salt(f)
    f.finish()
    return CompletionRequest(model, prompts, sampling, is_stream, include_usage, choices, cache_salt)


def _parse_content(value: Any, field: str) -> str:
    if isinstance(value, str):
        return check_text(value, field)
    if value is None:
        return ""
    if isinstance(value, list):
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequest(f"'{field}[{i}]' must be {{\"type\": \"text\", \"text\": string}}; only text "
                                     "content is supported", param=f"{field}[{i}]", code="invalid_type")
            texts.append(check_text(part["text"], f"{field}[{i}].text"))
        return "".join(texts)
    raise InvalidRequest(f"'{field}' must be a string or an array of text parts", param=field, code="invalid_type")


def _parse_messages(value: list) -> tuple[ChatMessage, ...]:
    if not value:
        raise InvalidRequest("'messages' must not be empty", param="messages", code="invalid_value")
    if len(value) > MAX_MESSAGES:
        raise InvalidRequest(f"'messages' has {len(value)} messages; at most {MAX_MESSAGES} are allowed",
                             param="messages", code="out_of_range")
    messages = []
    for i, raw in enumerate(value):
        if not isinstance(raw, dict):
            raise InvalidRequest(f"'messages[{i}]' must be an object", param=f"messages[{i}]", code="invalid_type")
        f = Fields(raw, prefix=f"messages[{i}].")
        role = f.take_str("role", required=True)
        if role not in CHAT_ROLES:
            raise InvalidRequest(f"'messages[{i}].role' must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                                 param=f"messages[{i}].role", code="invalid_value")
        tool_calls, tool_call_id = take_message_tool_fields(f, role)
        # OpenAI: an assistant message that calls tools may have no content.
        content = _parse_content(f.take_any("content", required=not tool_calls), f"messages[{i}].content")
        name = f.take_str("name")
        f.finish()
        messages.append(ChatMessage(role, content, name, tool_calls, tool_call_id))
    return tuple(messages)


def parse_chat(body: dict[str, Any]) -> ChatRequest:
    f = Fields(body)
    model = _take_model(f)
    messages = _parse_messages(f.take_list("messages", required=True))
    max_tokens = f.take_int("max_completion_tokens", None, low=1)
    legacy = f.take_int("max_tokens", None, low=1)
    sampling = _take_processing(f, _take_sampling(f, max_tokens if max_tokens is not None else legacy))
    is_stream, include_usage, continuous = _take_stream(f)
    _take_common_unsupported(f)
    sampling = replace(sampling, logprobs=_take_chat_logprobs(f))
    choices = _take_choices(f, 1, continuous)
    tools = take_tools(f)
    sampling = replace(sampling, structured=take_structured(f))
    add_generation_prompt, template = take_template_options(f, tools, messages)
    cache_salt = _take_cache_salt(f)
    f.finish()
    return ChatRequest(model, messages, sampling, is_stream, include_usage, add_generation_prompt, choices,
                       template, cache_salt)


def _take_chat_logprobs(f: Fields) -> int | None:
    """Chat spells logprobs as `logprobs: true` plus `top_logprobs: k` (OpenAI requires the first for the second)."""
    is_logprobs = f.take_bool("logprobs", False)
    top = f.take_int("top_logprobs", None, low=0, high=MAX_LOGPROBS)
    if top is not None and top > 0 and not is_logprobs:
        raise InvalidRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs", code="invalid_value")
    return (top or 0) if is_logprobs else None


def _take_adapter_name(f: Fields) -> str:
    name = f.take_str("lora_name", required=True)
    if not is_valid_adapter_name(name):
        raise InvalidRequest(f"'lora_name' must match {ADAPTER_NAME_RULE}, got {name!r}", param="lora_name",
                             code="invalid_value")
    return name


def _take_s3_access(f: Fields) -> S3Access | None:
    s3 = f.take_object("s3")
    if s3 is None:
        return None
    values = {}
    for key in S3_FIELDS:
        value = s3.take_str(key)
        if value is not None and not (0 < len(value) <= MAX_AUTH_TOKEN_CHARS and value.isprintable()):
            raise InvalidRequest(f"'{s3.name(key)}' must be 1..{MAX_AUTH_TOKEN_CHARS} printable characters",
                                 param=s3.name(key), code="invalid_value")
        values[key] = value
    s3.finish()
    try:
        return S3Access(**values)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="s3", code="invalid_value") from None


def parse_load_adapter(body: dict[str, Any]) -> LoadRequest:
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
    request = LoadRequest(name, path, f.take_bool("load_inplace", False), f.take_bool("preload", True),
                                 sha256.lower() if sha256 else None, auth_token, _take_s3_access(f))
    f.take_any("lora_int_id")  # vLLM clients send it; ids are ours to assign
    f.finish()
    return request


def parse_unload_adapter(body: dict[str, Any]) -> UnloadAdapterRequest:
    f = Fields(body)
    name = _take_adapter_name(f)
    f.take_any("lora_int_id")
    f.finish()
    return UnloadAdapterRequest(name)
