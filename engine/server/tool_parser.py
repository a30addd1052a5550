"""Tool calls read back from a chat completion's text, in the two formats open models commonly write:

- tagged (Hermes, Qwen 2.5/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call,
  with text around them; the last block may lack its closing tag (generation stopped at EOS);
- bare JSON (Llama 3.x): the text is one call `{"name": ..., "parameters"|"arguments": {...}}`, optionally after
  `<|python_tag|>`, or several separated by `;`, or a JSON array of them.

A call counts only when it names one of the request's tools, so a model asked for JSON that happens to hold a
"name" is not mistaken for a call. A tagged block that is not a valid call leaves the whole text as content, as
vLLM's Hermes parser does. `ToolOutput.visible` says how much of a growing text a stream may send as content:
everything before the point where a call could start.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_TAGGED = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CALL_CLOSE) + r"|\Z)", re.DOTALL)
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the API carries it

    def to_json(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedOutput:
    """content: the text outside the calls, unstripped (its start is the text's start up to the first call)."""

    content: str
    calls: tuple[ToolCall, ...]


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _to_call(obj: Any, names: frozenset[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(arguments, ensure_ascii=False))


def _decode(text: str) -> tuple[Any, int] | None:
    try:
        return _DECODER.raw_decode(text)
    except (ValueError, RecursionError):
        return None


def _parse_tagged(text: str, names: frozenset[str]) -> ParsedOutput | None:
    calls, outside, end = [], [], 0
    for match in _TAGGED.finditer(text):
        decoded = _decode(match.group(1).strip())
        call = _to_call(decoded[0], names) if decoded else None
        if call is None or match.group(1).strip()[decoded[1]:].strip():
            return None
        calls.append(call)
        outside.append(text[end:match.start()])
        end = match.end()
    if not calls:
        return None
    return ParsedOutput("".join(outside) + text[end:], tuple(calls))


def _parse_bare(text: str, names: frozenset[str]) -> ParsedOutput | None:
    rest = text.lstrip()
    rest = rest[len(PYTHON_TAG):].lstrip() if rest.startswith(PYTHON_TAG) else rest
    objects: list = []
    while rest.startswith(("{", "[")):
        decoded = _decode(rest)
        if decoded is None:
            return None
        value, end = decoded
        objects += value if isinstance(value, list) else [value]
        rest = rest[end:].lstrip()
        if rest.startswith((";", ",")):
            rest = rest[1:].lstrip()
    calls = [_to_call(obj, names) for obj in objects]
    if not calls or None in calls:
        return None
    return ParsedOutput(rest, tuple(calls))


def parse_tool_calls(text: str, names: frozenset[str]) -> ParsedOutput:
    """The calls in `text` (tagged first, then bare JSON); none: the whole text is content."""
    if TOOL_CALL_OPEN in text:
        return _parse_tagged(text, names) or ParsedOutput(text, ())
    return _parse_bare(text, names) or ParsedOutput(text, ())


def _partial_suffix(text: str, marker: str) -> int:
    """The first index from which `text` is a proper prefix of `marker` (len(text) when none)."""
    for start in range(max(0, len(text) - len(marker) + 1), len(text)):
        if marker.startswith(text[start:]):
            return start
    return len(text)


@dataclass(frozen=True)
class ToolOutput:
    """How one request's output is read for calls of `names`."""

    names: frozenset[str]
    forced: str | None = None  # tool_choice naming one function: a bare arguments object is its call too

    def parse(self, text: str) -> ParsedOutput:
        parsed = parse_tool_calls(text, self.names)
        if parsed.calls or self.forced is None:
            return parsed
        decoded = _decode(text.strip())
        if decoded is None or decoded[1] != len(text.strip()) or not isinstance(decoded[0], dict):
            return parsed
        return ParsedOutput("", (ToolCall(new_call_id(), self.forced, json.dumps(decoded[0], ensure_ascii=False)),))

    def visible(self, text: str) -> int:
        """Characters of `text` a stream may send as content now: never a part a call could still start in.

        Monotone in `text`'s growth, so what was sent stays a prefix of the parsed content."""
        head = text.lstrip()
        if not head or head.startswith(("{", "[")) or PYTHON_TAG.startswith(head[:len(PYTHON_TAG)]):
            return 0  # a bare JSON call may start here
        opened = text.find(TOOL_CALL_OPEN)
        return opened if opened >= 0 else _partial_suffix(text, TOOL_CALL_OPEN)
