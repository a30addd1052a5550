"""OpenAI response bodies: completions and chat, whole and as stream chunks, plus SSE framing."""

from __future__ import annotations

import json
from dataclasses import dataclass

from aiohttp import web

SSE_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None  # prompt tokens found in the prefix cache (None: not reported in this body)

    def to_json(self) -> dict:
        body = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}
        if self.cached_tokens is not None:
            body["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return body


@dataclass(frozen=True)
class Choice:
    index: int
    text: str
    finish_reason: str | None
    logprobs: dict | None = None  # completion_logprobs / chat_logprobs of this body's tokens
    prompt_logprobs: list | None = None  # vLLM's prompt_logprobs (on the first body of the choice)
    usage: Usage | None = None  # stream_options.continuous_usage_stats: this choice's usage so far
    tool_calls: tuple = ()  # chat: tool_parser.ToolCall read from the output (then `text` is the rest)


@dataclass(frozen=True)
class Envelope:
    """What every body of one response shares."""

    id: str
    created: int
    model: str
    is_chat: bool

    def _base(self, suffix: str) -> dict:
        kind = "chat.completion" if self.is_chat else "text_completion"
        return {"id": self.id, "object": kind + suffix, "created": self.created, "model": self.model}

    def whole(self, choices: list[Choice], usage: Usage) -> dict:
        body = self._base("")
        body["choices"] = [self._whole_choice(c) for c in choices]
        body["usage"] = usage.to_json()
        if self.is_chat and choices and choices[0].prompt_logprobs is not None:  # vLLM: top level in chat
            body["prompt_logprobs"] = choices[0].prompt_logprobs
        return body

    def _whole_choice(self, c: Choice) -> dict:
        if self.is_chat:
            message: dict = {"role": "assistant", "content": c.text}
            if c.tool_calls:
                message["content"] = c.text or None
                message["tool_calls"] = [call.to_json() for call in c.tool_calls]
            return {"index": c.index, "message": message, "logprobs": c.logprobs, "finish_reason": c.finish_reason}
        body = {"index": c.index, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish_reason}
        if c.prompt_logprobs is not None:
            body["prompt_logprobs"] = c.prompt_logprobs
        return body

    def chunk(self, choice: Choice, *, is_first: bool = False) -> dict:
        """One stream chunk: `choice.text` is the delta; chat's first chunk also carries the role."""
        body = self._base(".chunk" if self.is_chat else "")
        if self.is_chat:
            delta: dict = {"role": "assistant", "content": choice.text} if is_first else {}
            if choice.text and not is_first:
                delta["content"] = choice.text
            if choice.tool_calls:  # all at once, when the output is complete
                delta["tool_calls"] = [{"index": j, **call.to_json()} for j, call in enumerate(choice.tool_calls)]
            body["choices"] = [{"index": choice.index, "delta": delta, "logprobs": choice.logprobs,
                                "finish_reason": choice.finish_reason}]
            if choice.prompt_logprobs is not None:
                body["prompt_logprobs"] = choice.prompt_logprobs
        else:
            body["choices"] = [{"index": choice.index, "text": choice.text, "logprobs": choice.logprobs,
                                "finish_reason": choice.finish_reason}]
            if choice.prompt_logprobs is not None:
                body["choices"][0]["prompt_logprobs"] = choice.prompt_logprobs
        if choice.usage is not None:
            body["usage"] = choice.usage.to_json()
        return body

    def usage_chunk(self, usage: Usage) -> dict:
        body = self._base(".chunk" if self.is_chat else "")
        body["choices"] = []
        body["usage"] = usage.to_json()
        return body


def completion_logprobs(entries: list, text_offset: int) -> dict:
    """OpenAI completions' logprobs of `entries` (engine PositionLogprobs; None for a prompt's first token),
    whose text starts at character `text_offset` of the choice's text."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for entry in entries:
        if entry is None:
            tokens.append(""), token_logprobs.append(None), top_logprobs.append(None), offsets.append(text_offset)
            continue
        tokens.append(entry.chosen.token)
        token_logprobs.append(entry.chosen.logprob)
        top_logprobs.append({t.token: t.logprob for t in entry.top})
        offsets.append(text_offset)
        text_offset += len(entry.chosen.token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def chat_logprobs(entries: list) -> dict:
    """OpenAI chat's logprobs: per token its text, logprob, UTF-8 bytes and the top alternatives."""
    def one(t) -> dict:
        return {"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode("utf-8", "replace"))}

    return {"content": [{**one(e.chosen), "top_logprobs": [one(t) for t in e.top]} for e in entries],
            "refusal": None}


def prompt_logprobs_json(entries: tuple) -> list:
    """vLLM's prompt_logprobs: None for the first prompt token, then {token id: {logprob, decoded_token}} with
    the prompt's own token and the top ones."""
    def one(t) -> tuple[str, dict]:
        return str(t.token_id), {"logprob": t.logprob, "decoded_token": t.token}

    return [None] + [dict([one(e.chosen), *(one(t) for t in e.top)]) for e in entries]


def sse_event(body: dict) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


async def start_sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    await response.prepare(request)
    return response
