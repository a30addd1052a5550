"""One HTTP request's engine requests and how their outputs become OpenAI choices, whole or streamed.

A request of P prompts with `n` asks the engine for P x n requests (choice index prompt * n + j; each its own
engine request, the j-th with seed + j when a seed is given). Echo puts the prompt's text (and, with
logprobs, its logprobs) before the completion; usage counts each prompt once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from aiohttp import web

from kubelora.contract.errors import AdapterUnavailable, EngineFault, RequestFailed, ServiceError
from kubelora.contract.http_errors import to_http
from kubelora.contract.errors import FailureKind
from kubelora.engine.sampling_params import SamplingParams
from kubelora.engine.server.async_engine import EngineRequest, RequestGroup
from kubelora.engine.server.protocol import MAX_SEED, Choices
from kubelora.engine.server.responses import (SSE_DONE, Choice, Envelope, Usage, chat_logprobs, completion_logprobs,
                                              prompt_logprobs_json, sse_event, start_sse)
from kubelora.engine.server.tool_parser import ToolOutput

if TYPE_CHECKING:  # the engine's public names; no import cost at runtime
    from kubelora.engine import RequestOutput


@dataclass(frozen=True)
class ChoicePlan:
    prompts: list[list[int]]  # token ids per prompt, after truncation
    params: SamplingParams
    choices: Choices
    echo_texts: list[str]  # per prompt: the text echoed before its completions ("" without echo)
    is_stream: bool
    include_usage: bool
    tools: ToolOutput | None = None  # chat with tools (tool_choice not "none"): the output is read for calls
    cache_salt: str | None = None

    def requests(self, envelope_id: str, adapter: str | None) -> list[EngineRequest]:
        n = self.choices.n
        return [EngineRequest(f"{envelope_id}-{i * n + j}", tokens, _nth_params(self.params, j), adapter,
                              self.cache_salt)
                for i, tokens in enumerate(self.prompts) for j in range(n)]

    def prompt_tokens(self, index: int) -> int:
        return len(self.prompts[index // self.choices.n])

    def echo_text(self, index: int) -> str:
        return self.echo_texts[index // self.choices.n]


def truncate_prompt(tokens: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """The last `keep` tokens (-1: the last max_model_len - 1, room for one generated token)."""
    if keep is None:
        return tokens
    keep = max_model_len - 1 if keep == -1 else keep
    return tokens[-keep:]


def _nth_params(params: SamplingParams, j: int) -> SamplingParams:
    if j == 0 or params.seed is None:
        return params
    return replace(params, seed=(params.seed + j + MAX_SEED + 1) % (2 * (MAX_SEED + 1)) - MAX_SEED - 1)


def _read_calls(plan: ChoicePlan, text: str, finish_reason: str | None) -> tuple[str, tuple, str | None]:
    """The content, the tool calls and the finish reason of a finished output: "tool_calls" when it made calls,
    whose text outside the calls is the content."""
    parsed = plan.tools.parse(text) if plan.tools is not None else None
    if parsed is None or not parsed.calls:
        return text, (), finish_reason
    return parsed.content, parsed.calls, "tool_calls"


def _check_not_failed(output: RequestOutput) -> None:
    if output.finish_reason == "error":
        raise _failure_error(output)


def _failure_error(output: RequestOutput) -> ServiceError:
    """The error a request the engine failed is answered with (engine/outputs.py FailureKind): an adapter load
    failure is 503 and a retry loads it again; logits that are not finite, or parameters that leave no token,
    are the request's (its adapter's) own fault, 422 whatever the retry; an exception in the engine's work for
    it is our bug, 500."""
    message = output.error or "the engine failed this request"
    kind = output.error_kind
    if kind is FailureKind.ADAPTER_LOAD:
        return AdapterUnavailable(output.error or f"adapter {output.adapter!r} failed to load", param="model")
    if kind is FailureKind.NON_FINITE_LOGITS:
        return RequestFailed(message, param="model" if output.adapter else None, code="non_finite_logits")
    if kind is FailureKind.NO_TOKEN_LEFT:
        return RequestFailed(message, code="no_token_left")
    return EngineFault(message)


def _usage(plan: ChoicePlan, group: RequestGroup, finals: dict[str, RequestOutput]) -> Usage:
    """Each prompt counted once, with the prompt tokens its first choice found in the prefix cache."""
    first_choices = [finals[rid] for rid in group.request_ids[:: plan.choices.n] if rid in finals]
    return Usage(sum(len(p) for p in plan.prompts), sum(len(o.token_ids) for o in finals.values()),
                 sum(o.num_cached_tokens for o in first_choices))


def _logprobs(plan: ChoicePlan, envelope: Envelope, entries: tuple, prompt: tuple | None, offset: int) -> dict | None:
    if plan.params.logprobs is None:
        return None
    if envelope.is_chat:
        return chat_logprobs(list(entries))
    head = [None, *prompt] if plan.choices.echo and prompt is not None else []
    return completion_logprobs(head + list(entries), offset)


def _prompt_logprobs(plan: ChoicePlan, output: RequestOutput) -> list | None:
    if plan.params.prompt_logprobs is None or output.prompt_logprobs is None:
        return None
    return prompt_logprobs_json(output.prompt_logprobs)


async def whole(group: RequestGroup, envelope: Envelope, plan: ChoicePlan) -> dict:
    finals: dict[str, RequestOutput] = {}
    async for output in group:
        if output.finished:
            _check_not_failed(output)
            finals[output.request_id] = output
    choices = []
    for i, rid in enumerate(group.request_ids):
        out = finals[rid]
        logprobs = _logprobs(plan, envelope, out.logprobs or (), out.prompt_logprobs, 0)
        text, calls, finish_reason = _read_calls(plan, out.text, out.finish_reason)
        if calls:
            text = text.strip()
        choices.append(Choice(i, plan.echo_text(i) + text, finish_reason, logprobs, _prompt_logprobs(plan, out),
                              tool_calls=calls))
    return envelope.whole(choices, _usage(plan, group, finals))


async def stream(request: web.Request, group: RequestGroup, envelope: Envelope,
                 plan: ChoicePlan) -> web.StreamResponse:
    response = await start_sse(request)
    index = {rid: i for i, rid in enumerate(group.request_ids)}
    sent: dict[str, int] = {}  # characters of text already sent, per request
    offsets: dict[str, int] = {}  # completions logprobs: characters of the tokens already reported
    finals: dict[str, RequestOutput] = {}
    try:
        async for output in group:
            _check_not_failed(output)
            rid, i = output.request_id, index[output.request_id]
            is_first = rid not in sent
            # With tools, text where a call may start is held back until the output is complete.
            visible = len(output.text) if plan.tools is None or output.finished else plan.tools.visible(output.text)
            text, calls, finish_reason = output.text, (), output.finish_reason
            if output.finished:
                text, calls, finish_reason = _read_calls(plan, output.text, output.finish_reason)
            delta = text[sent.get(rid, 0):visible]
            if calls and not delta.strip():
                delta = ""
            if is_first:
                delta = plan.echo_text(i) + delta
            logprobs = None
            if output.new_logprobs or (is_first and plan.choices.echo and output.prompt_logprobs):
                logprobs = _logprobs(plan, envelope, output.new_logprobs,
                                     output.prompt_logprobs if is_first else None, offsets.get(rid, 0))
                if logprobs is not None and not envelope.is_chat:
                    offsets[rid] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
            if delta or output.finished or (is_first and envelope.is_chat) or logprobs is not None:
                usage = None
                if plan.choices.continuous_usage_stats:
                    usage = Usage(plan.prompt_tokens(i), len(output.token_ids))
                prompt_lp = _prompt_logprobs(plan, output) if is_first else None
                choice = Choice(i, delta, finish_reason, logprobs, prompt_lp, usage, calls)
                await response.write(sse_event(envelope.chunk(choice, is_first=is_first)))
                sent[rid] = visible
            if output.finished:
                finals[rid] = output
        if plan.include_usage:
            await response.write(sse_event(envelope.usage_chunk(_usage(plan, group, finals))))
    except ServiceError as exc:
        await response.write(sse_event(to_http(exc).body()))
    await response.write(SSE_DONE)
    await response.write_eof()
    return response
