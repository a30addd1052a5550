"""`POST /v1/completions` and `POST /v1/chat/completions`, whole or streamed (SSE, `data: [DONE]`).

Every check that can fail with a status code (body, model, lengths, queue room) runs before the first byte
is written; after that, failures travel as an SSE `{"error": ...}` event followed by `[DONE]`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from aiohttp import web

from kubelora.engine.common.errors import AdapterUnavailable, ServiceError
from kubelora.engine.common.http_errors import to_http
from kubelora.engine.sampling_params import SamplingParams
from kubelora.engine.server.async_engine import EngineRequest, RequestGroup
from kubelora.engine.server.fields import decode_json_object
from kubelora.engine.server.protocol import parse_chat, parse_completion
from kubelora.engine.server.responses import SSE_DONE, Choice, Envelope, Usage, sse_event, start_sse
from kubelora.engine.server.serving import Serving

if TYPE_CHECKING:  # the engine's public names; no import cost at runtime
    from kubelora.engine import RequestOutput


class OpenAIRoutes:
    def __init__(self, get_serving: Callable[[], Serving]) -> None:
        self._serving = get_serving

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        serving = self._serving()
        req = parse_completion(decode_json_object(await request.read()))
        adapter = serving.resolve_model(req.model)
        prompts = await serving.prompts.encode(req.prompts)
        for tokens in prompts:
            serving.check_length(len(tokens), req.sampling.max_tokens, "prompt")
        envelope = Envelope(f"cmpl-{uuid.uuid4().hex}", int(time.time()), req.model, is_chat=False)
        params = req.sampling.to_params("completion")
        return await _serve(request, serving, envelope, prompts, params, adapter, req.is_stream, req.include_usage)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        serving = self._serving()
        req = parse_chat(decode_json_object(await request.read()))
        adapter = serving.resolve_model(req.model)
        tokens = await serving.prompts.render_chat(req.messages, req.add_generation_prompt)
        serving.check_length(len(tokens), req.sampling.max_tokens, "messages")
        envelope = Envelope(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), req.model, is_chat=True)
        params = req.sampling.to_params("chat")
        return await _serve(request, serving, envelope, [tokens], params, adapter, req.is_stream, req.include_usage)


async def _serve(request: web.Request, serving: Serving, envelope: Envelope, prompts: list[list[int]],
                 params: SamplingParams, adapter: str | None, is_stream: bool,
                 include_usage: bool) -> web.StreamResponse:
    requests = [EngineRequest(f"{envelope.id}-{i}", tokens, params, adapter) for i, tokens in enumerate(prompts)]
    group = serving.engine.submit(requests)
    try:
        if is_stream:
            return await _stream(request, group, envelope, include_usage)
        return web.json_response(await _whole(group, envelope))
    finally:
        group.close()  # aborts whatever has not finished: the client left or the handler was cancelled


def _usage(finals: dict[str, RequestOutput]) -> Usage:
    return Usage(sum(o.num_prompt_tokens for o in finals.values()), sum(len(o.token_ids) for o in finals.values()))


def _check_not_failed(output: RequestOutput) -> None:
    if output.finish_reason == "error":
        raise AdapterUnavailable(output.error or f"adapter {output.adapter!r} failed to load", param="model")


async def _whole(group: RequestGroup, envelope: Envelope) -> dict:
    finals: dict[str, RequestOutput] = {}
    async for output in group:
        if output.finished:
            _check_not_failed(output)
            finals[output.request_id] = output
    choices = [Choice(i, finals[rid].text, finals[rid].finish_reason) for i, rid in enumerate(group.request_ids)]
    return envelope.whole(choices, _usage(finals))


async def _stream(request: web.Request, group: RequestGroup, envelope: Envelope,
                  include_usage: bool) -> web.StreamResponse:
    response = await start_sse(request)
    index = {rid: i for i, rid in enumerate(group.request_ids)}
    sent: dict[str, int] = {}  # characters of text already sent, per request
    finals: dict[str, RequestOutput] = {}
    try:
        async for output in group:
            _check_not_failed(output)
            rid = output.request_id
            delta = output.text[sent.get(rid, 0):]
            is_first = rid not in sent
            if delta or output.finished or (is_first and envelope.is_chat):
                choice = Choice(index[rid], delta, output.finish_reason)
                await response.write(sse_event(envelope.chunk(choice, is_first=is_first)))
                sent[rid] = len(output.text)
            if output.finished:
                finals[rid] = output
        if include_usage:
            await response.write(sse_event(envelope.usage_chunk(_usage(finals))))
    except ServiceError as exc:
        await response.write(sse_event(to_http(exc).body()))
    await response.write(SSE_DONE)
    await response.write_eof()
    return response
