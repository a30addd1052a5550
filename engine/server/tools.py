"""Chat tools at the HTTP edge: `tools`, `tool_choice`, and the tool fields of messages (assistant `tool_calls`,
`tool_call_id` of role "tool"), validated into what the chat template receives.

Names and shapes follow the OpenAI API: a tool is `{"type": "function", "function": {"name", "description",
"parameters", "strict"}}`; `tool_choice` is "none", "auto", "required" or `{"type": "function", "function":
{"name"}}`. A call's `arguments` is a JSON string in the API; templates (Qwen, Hermes, Llama 3) render it with
`| tojson`, so like vLLM we hand them the decoded object when the string holds one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from kubelora.contract.errors import InvalidRequest
from kubelora.engine.server.fields import Fields
from kubelora.engine.server.json_body import check_tree
from kubelora.engine.server.tool_parser import ToolOutput

MAX_TOOLS = 128  # OpenAI's limit
MAX_TOOLS_CHARS = 256 << 10  # the tools as compact JSON: the template writes all of them into every prompt
MAX_TOOL_CALLS = 128  # per assistant message
TOOL_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
TOOL_CHOICE_MODES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolRequest:
    """The request's tools as the template gets them (JSON objects), and how the output is read.

    choice: "none" (the output is never parsed for calls), "auto", "required", or the name of one function.
    """

    tools: tuple[dict, ...]
    choice: str

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)

    def num_chars(self) -> int:
        return len(json.dumps(list(self.tools)))

    def reader(self) -> ToolOutput | None:
        """How the output is read for calls: not at all for "none"; a named choice accepts only that function."""
        if self.choice == "none":
            return None
        if self.choice in TOOL_CHOICE_MODES:
            return ToolOutput(self.names)
        return ToolOutput(frozenset({self.choice}), forced=self.choice)


def _error(param: str, message: str, code: str = "invalid_value") -> InvalidRequest:
    return InvalidRequest(f"'{param}' {message}", param=param, code=code)


def _take_name(f: Fields) -> str:
    name = f.take_str("name", required=True)
    if not TOOL_NAME_RE.fullmatch(name):
        raise _error(f.name("name"), f"must match {TOOL_NAME_RE.pattern}, got {name!r}")
    return name


def _parse_tool(raw: Any, i: int) -> dict:
    if not isinstance(raw, dict):
        raise _error(f"tools[{i}]", "must be an object", "invalid_type")
    f = Fields(raw, prefix=f"tools[{i}].")
    f.take_unsupported("type", "function")
    function = f.take_object("function")
    if function is None:
        raise _error(f.name("function"), "is required", "missing_field")
    f.finish()
    tool: dict = {"name": _take_name(function)}
    description = function.take_str("description")
    if description is not None:
        tool["description"] = description
    parameters = function.take_object("parameters")
    if parameters is not None:
        tool["parameters"] = raw["function"]["parameters"]  # a JSON schema, passed to the template as given
    function.take_bool("strict", False)  # accepted; not enforced (no constrained decoding of arguments)
    function.finish()
    return {"type": "function", "function": tool}


def _parse_choice(value: Any, names: set[str]) -> str:
    if value is None:
        return "auto" if names else "none"
    if isinstance(value, str):
        if value not in TOOL_CHOICE_MODES:
            raise _error("tool_choice", f"must be one of {', '.join(TOOL_CHOICE_MODES)} or a named function, got "
                         f"{value!r}")
        if value == "required" and not names:
            raise _error("tool_choice", "is 'required' but 'tools' is empty")
        return value
    if not isinstance(value, dict):
        raise _error("tool_choice", "must be a string or {\"type\": \"function\", \"function\": {\"name\"}}",
                     "invalid_type")
    f = Fields(value, prefix="tool_choice.")
    f.take_unsupported("type", "function")
    function = f.take_object("function")
    if function is None:
        raise _error("tool_choice.function", "is required", "missing_field")
    name = function.take_str("name", required=True)
    function.finish()
    f.finish()
    if name not in names:
        raise _error("tool_choice.function.name", f"names {name!r}, which is not in 'tools'")
    return name


def take_tools(f: Fields) -> ToolRequest | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` (accepted; every parsed call is returned)."""
    raw = f.take_list("tools") or []
    if len(raw) > MAX_TOOLS:
        raise _error("tools", f"has {len(raw)} tools; at most {MAX_TOOLS} are allowed", "out_of_range")
    tools = tuple(_parse_tool(t, i) for i, t in enumerate(raw))
    num_chars = len(json.dumps(tools, separators=(",", ":")))
    if num_chars > MAX_TOOLS_CHARS:
        raise _error("tools", f"is {num_chars} characters as JSON; at most {MAX_TOOLS_CHARS} are allowed",
                     "out_of_range")
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise _error("tools", f"names a function twice: {sorted(n for n in set(names) if names.count(n) > 1)}")
    choice = _parse_choice(f.take_any("tool_choice"), set(names))
    f.take_bool("parallel_tool_calls", True)
    return ToolRequest(tools, choice) if tools else None


def _template_arguments(function: Fields) -> Any:
    """The API's JSON string (or an object), decoded for the template when it holds an object (kept as text
    otherwise). The decoded object is held to the body's bounds: its escapes may spell lone surrogates."""
    value = function.take_any("arguments", required=True)
    if isinstance(value, dict):
        return value
    value = function.take_str("arguments")  # checked as every text field is; not a string: 400 invalid_type
    try:
        decoded = json.loads(value)
    except (ValueError, RecursionError):
        return value
    if not isinstance(decoded, dict):
        return value
    check_tree(decoded, function.name("arguments"))
    return decoded


def _parse_call(raw: Any, prefix: str) -> dict:
    if not isinstance(raw, dict):
        raise _error(prefix.rstrip("."), "must be an object", "invalid_type")
    f = Fields(raw, prefix=prefix)
    call_id = f.take_str("id", required=True)
    f.take_unsupported("type", "function")
    function = f.take_object("function")
    if function is None:
        raise _error(f.name("function"), "is required", "missing_field")
    f.finish()
    name = function.take_str("name", required=True)
    arguments = _template_arguments(function)
    function.finish()
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def take_message_tool_fields(f: Fields, role: str) -> tuple[tuple[dict, ...], str | None]:
    """An assistant message's `tool_calls` and a tool message's `tool_call_id` (required there, as in OpenAI)."""
    raw_calls = f.take_list("tool_calls") or []
    if raw_calls and role != "assistant":
        raise _error(f.name("tool_calls"), f"is only allowed on assistant messages, not {role!r}")
    if len(raw_calls) > MAX_TOOL_CALLS:
        raise _error(f.name("tool_calls"), f"has {len(raw_calls)} calls; at most {MAX_TOOL_CALLS} are allowed",
                     "out_of_range")
    calls = tuple(_parse_call(c, f"{f.name('tool_calls')}[{i}].") for i, c in enumerate(raw_calls))
    call_id = f.take_str("tool_call_id", required=role == "tool")
    if call_id is not None and role != "tool":
        raise _error(f.name("tool_call_id"), f"is only allowed on tool messages, not {role!r}")
    return calls, call_id
