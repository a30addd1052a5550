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

    def to_json(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


@dataclass(frozen=True)
class Choice:
    index: int
    text: str
    finish_reason: str | None


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
        return body

    def _whole_choice(self, c: Choice) -> dict:
        if self.is_chat:
            return {"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
                    "finish_reason": c.finish_reason}
        return {"index": c.index, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}

    def chunk(self, choice: Choice, *, is_first: bool = False) -> dict:
        """One stream chunk: `choice.text` is the delta; chat's first chunk also carries the role."""
        body = self._base(".chunk" if self.is_chat else "")
        if self.is_chat:
            delta: dict = {"role": "assistant", "content": choice.text} if is_first else {}
            if choice.text and not is_first:
                delta["content"] = choice.text
            body["choices"] = [{"index": choice.index, "delta": delta, "logprobs": None,
                                "finish_reason": choice.finish_reason}]
        else:
            body["choices"] = [{"index": choice.index, "text": choice.text, "logprobs": None,
                                "finish_reason": choice.finish_reason}]
        return body

    def usage_chunk(self, usage: Usage) -> dict:
        body = self._base(".chunk" if self.is_chat else "")
        body["choices"] = []
        body["usage"] = usage.to_json()
        return body


def sse_event(body: dict) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


async def start_sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    await response.prepare(request)
    return response
