"""`POST /v1/completions` and `POST /v1/chat/completions`, whole or streamed (SSE, `data: [DONE]`).

Every check that can fail with a status code (body, model, lengths, queue room) runs before the first byte
is written; after that, failures travel as an SSE `{"error": ...}` event followed by `[DONE]`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from aiohttp import web

from kubelora.engine.server.choices import ChoicePlan, stream, truncate_prompt, whole
from kubelora.engine.server.api_keys import GRANT
from kubelora.engine.server.fields import parse_body
from kubelora.engine.server.protocol import CompletionRequest, parse_chat, parse_completion
from kubelora.engine.server.responses import Envelope
from kubelora.engine.server.serving import Serving
from kubelora.engine.server.structured import attach_grammar


class OpenAIRoutes:
    def __init__(self, get_serving: Callable[[], Serving]) -> None:
        self._serving = get_serving

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        serving = self._serving()
        req = await parse_body(request, parse_completion)
        adapter = serving.resolve_model(req.model, request.get(GRANT))
        prompts = await serving.prompts.encode(req.prompts)
        keep = req.choices.truncate_prompt_tokens
        prompts = [truncate_prompt(tokens, keep, serving.max_model_len) for tokens in prompts]
        for tokens in prompts:
            serving.check_length(len(tokens), req.sampling.max_tokens, "prompt")
        envelope = Envelope(f"cmpl-{uuid.uuid4().hex}", int(time.time()), req.model, is_chat=False)
        params = req.sampling.to_params(await serving.prompts.encode_words(req.sampling.bad_words))
        params = await attach_grammar(serving.engine, params)  # compiled on the engine's grammar pool
        plan = ChoicePlan(prompts, params, req.choices, await _echo_texts(serving, req, prompts), req.is_stream,
                          req.include_usage, cache_salt=req.cache_salt)
        return await _serve(request, serving, envelope, plan, adapter)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        serving = self._serving()
        req = await parse_body(request, parse_chat)
        adapter = serving.resolve_model(req.model, request.get(GRANT))
        tokens = await serving.prompts.render_chat(req.messages, req.add_generation_prompt, req.template)
        tokens = truncate_prompt(tokens, req.choices.truncate_prompt_tokens, serving.max_model_len)
        serving.check_length(len(tokens), req.sampling.max_tokens, "messages")
        envelope = Envelope(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), req.model, is_chat=True)
        params = req.sampling.to_params(await serving.prompts.encode_words(req.sampling.bad_words))
        params = await attach_grammar(serving.engine, params)  # compiled on the engine's grammar pool
        tools = req.template.tools.reader() if req.template.tools is not None else None
        plan = ChoicePlan([tokens], params, req.choices, [""], req.is_stream, req.include_usage, tools,
                          req.cache_salt)
        return await _serve(request, serving, envelope, plan, adapter)


async def _serve(request: web.Request, serving: Serving, envelope: Envelope, plan: ChoicePlan,
                 adapter: str | None) -> web.StreamResponse:
    group = serving.engine.submit(plan.requests(envelope.id, adapter))
    try:
        if plan.is_stream:
            return await stream(request, group, envelope, plan)
        return web.json_response(await whole(group, envelope, plan))
    finally:
        group.close()  # aborts whatever has not finished: the client left or the handler was cancelled


async def _echo_texts(serving: Serving, req: CompletionRequest, prompts: list[list[int]]) -> list[str]:
    """The prompt as the client wrote it; decoded from its tokens when given as ids or truncated."""
    if not req.choices.echo:
        return [""] * len(prompts)
    texts = []
    for given, tokens in zip(req.prompts, prompts):
        is_verbatim = isinstance(given, str) and req.choices.truncate_prompt_tokens is None
        texts.append(given if is_verbatim else await serving.prompts.decode(tokens))
    return texts
