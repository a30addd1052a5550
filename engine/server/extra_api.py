"""vLLM's utility endpoints: `POST /tokenize`, `POST /detokenize`, `GET /version`.

`/tokenize` takes a completion prompt (`prompt`, `add_special_tokens` default true) or a chat (`messages` with
the chat fields that shape the template's text: `add_generation_prompt`, `continue_final_message`,
`chat_template_kwargs`, `tools`; `add_special_tokens` default false, the template writes them) and answers
`{count, max_model_len, tokens, token_strs}`. Tokenizing runs on the tokenizer thread behind the same character
bound as a completion; a prompt longer than max-model-len is still counted (that is what callers ask it for).
`/detokenize` takes at most max-model-len ids.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kubelora.contract.errors import InvalidRequest
from kubelora.engine.server.chat_template import TemplateOptions, take_template_options
from kubelora.engine.server.api_keys import GRANT
from kubelora.engine.server.fields import Fields, parse_body
from kubelora.engine.server.protocol import ChatMessage, _parse_messages
from kubelora.engine.server.serving import Serving
from kubelora.engine.server.tools import take_tools


@dataclass(frozen=True)
class TokenizeRequest:
    model: str | None
    prompt: str | None  # completion form; else `messages`
    messages: tuple[ChatMessage, ...]
    add_generation_prompt: bool
    template: TemplateOptions
    add_special_tokens: bool
    is_token_strs: bool  # return_token_strs


@dataclass(frozen=True)
class DetokenizeRequest:
    model: str | None
    tokens: tuple[int, ...]


def parse_tokenize(body: dict[str, Any]) -> TokenizeRequest:
    f = Fields(body)
    model = f.take_str("model")
    is_token_strs = f.take_bool("return_token_strs", False)
    if "messages" in body:
        if "prompt" in body:
            raise InvalidRequest("give 'prompt' or 'messages', not both", param="prompt", code="invalid_value")
        messages = _parse_messages(f.take_list("messages", required=True))
        add_generation_prompt, template = take_template_options(f, take_tools(f), messages)
        request = TokenizeRequest(model, None, messages, add_generation_prompt, template,
                                  f.take_bool("add_special_tokens", False), is_token_strs)
    else:
        prompt = f.take_str("prompt", required=True)
        request = TokenizeRequest(model, prompt, (), False, TemplateOptions(),
                                  f.take_bool("add_special_tokens", True), is_token_strs)
    f.finish()
    return request


def parse_detokenize(body: dict[str, Any]) -> DetokenizeRequest:
    f = Fields(body)
    model = f.take_str("model")
    tokens = f.take_list("tokens", required=True)
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
        raise InvalidRequest("'tokens' must be an array of non-negative integers", param="tokens",
                             code="invalid_type")
    f.finish()
    return DetokenizeRequest(model, tuple(tokens))


class ExtraRoutes:
    def __init__(self, get_serving: Callable[[], Serving]) -> None:
        self._serving = get_serving

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/version", version)

    async def tokenize(self, request: web.Request) -> web.Response:
        serving = self._serving()
        req = await parse_body(request, parse_tokenize)
        if req.model is not None:
            serving.resolve_model(req.model, request.get(GRANT))
        if req.prompt is not None:
            tokens = (await serving.prompts.encode((req.prompt,), req.add_special_tokens))[0]
        else:
            tokens = await serving.prompts.render_chat(req.messages, req.add_generation_prompt, req.template,
                                                       req.add_special_tokens)
        token_strs = await serving.prompts.token_strs(tokens) if req.is_token_strs else None
        return web.json_response({"count": len(tokens), "max_model_len": serving.max_model_len, "tokens": tokens,
                                  "token_strs": token_strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        serving = self._serving()
        req = await parse_body(request, parse_detokenize)
        if req.model is not None:
            serving.resolve_model(req.model, request.get(GRANT))
        if len(req.tokens) > serving.max_model_len:
            raise InvalidRequest(f"'tokens' has {len(req.tokens)} ids; at most max-model-len "
                                 f"({serving.max_model_len})", param="tokens", code="out_of_range")
        vocab = serving.prompts.vocab_size
        bad = next((t for t in req.tokens if t >= vocab), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} in 'tokens' is outside the vocabulary [0, {vocab})",
                                 param="tokens", code="invalid_value")
        return web.json_response({"prompt": await serving.prompts.decode(list(req.tokens))})


async def version(request: web.Request) -> web.Response:
    try:
        number = importlib.metadata.version("kubelora")
    except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
        number = "unknown"
    return web.json_response({"version": number})
