"""Tool calls read from output text: tagged (Hermes/Qwen) and bare JSON (Llama 3), and what a stream may send."""

from __future__ import annotations

import json

import pytest

from kubelora.engine.server.tool_parser import ToolOutput, parse_tool_calls

NAMES = frozenset({"get_weather", "search"})


def _calls(text: str) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parse_tool_calls(text, NAMES).calls]


@pytest.mark.parametrize("text, calls, content", [
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
     [("get_weather", {"city": "Paris"})], ""),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     [("get_weather", {"city": "Paris"})], ""),
    ('Let me look.\n<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>',
     [("search", {"q": "x"})], "Let me look.\n"),
    ('<tool_call>{"name": "search", "arguments": {"q": "a"}}</tool_call>\n<tool_call>{"name": "get_weather", '
     '"arguments": {"city": "Rome"}}</tool_call> done', [("search", {"q": "a"}), ("get_weather", {"city": "Rome"})],
     "\n done"),
    ('<tool_call>{"name": "search", "arguments": {"q": "a"}}', [("search", {"q": "a"})], ""),  # stopped at EOS
    ('<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"s\\"}"}</tool_call>', [("search", {"q": "s"})], ""),
    ('<tool_call>{"name": "search", "parameters": {"q": "p"}}</tool_call>', [("search", {"q": "p"})], ""),
    ('<tool_call>{"name": "search"}</tool_call>', [("search", {})], ""),
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', [("get_weather", {"city": "Oslo"})], ""),
    ('  {"name": "get_weather", "arguments": {"city": "Oslo"}}  ', [("get_weather", {"city": "Oslo"})], ""),
    ('<|python_tag|>{"name": "search", "parameters": {"q": "z"}}', [("search", {"q": "z"})], ""),
    ('{"name": "search", "parameters": {"q": "1"}}; {"name": "search", "parameters": {"q": "2"}}',
     [("search", {"q": "1"}), ("search", {"q": "2"})], ""),
    ('[{"name": "search", "arguments": {"q": "1"}}, {"name": "get_weather", "arguments": {"city": "B"}}]',
     [("search", {"q": "1"}), ("get_weather", {"city": "B"})], ""),
    ('{"name": "search", "parameters": {"q": "ü"}} and then some', [("search", {"q": "ü"})], "and then some"),
])
def test_calls_found(text, calls, content):
    parsed = parse_tool_calls(text, NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    assert parsed.content == content
    assert len({c.id for c in parsed.calls}) == len(calls) and all(c.id.startswith("chatcmpl-tool-")
                                                                   for c in parsed.calls)


@pytest.mark.parametrize("text", [
    "Just an answer.",
    "",
    '<tool_call>{"name": "search", "arguments": {"q": </tool_call>',  # invalid JSON
    '<tool_call>{"name": "delete_all", "arguments": {}}</tool_call>',  # not one of the tools
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "search", "arguments": [1]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "search", "arguments": {}} trailing</tool_call>',  # text inside the tags
    '<tool_call>{"name": "search", "arguments": {}}</tool_call><tool_call>oops</tool_call>',  # one bad block
    '{"name": "Ada", "age": 36}',  # JSON that is no call
    '{"answer": 42}',
    '{"name": "search", "parameters": {"q": 1}',  # cut off
    'The call is {"name": "search", "parameters": {}}',  # bare JSON only at the start
    '[1, 2, 3]',
    '{"name": "search", "arguments": "not json"}',
])
def test_no_calls_leave_the_text(text):
    parsed = parse_tool_calls(text, NAMES)
    assert parsed.calls == () and parsed.content == text


def test_named_choice_takes_bare_arguments():
    reader = ToolOutput(frozenset({"get_weather"}), forced="get_weather")
    parsed = reader.parse(' {"city": "Lima"} ')
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", {"city": "Lima"})]
    assert reader.parse('{"name": "search", "arguments": {}}').calls[0].name == "get_weather"  # as arguments
    assert reader.parse("no call").calls == ()


@pytest.mark.parametrize("text", [
    'Let me check. <tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call> ok',
    '{"name": "search", "parameters": {"q": "x"}}',
    '<|python_tag|>{"name": "search", "parameters": {"q": "x"}}',
    "Plain <tool text that <tool_call is no call",
    "  leading spaces then <tool_call>{\"name\": \"search\", \"arguments\": {}}</tool_call>",
    '<tool_call>{"name": "search", "arguments": {"q": ',
])
def test_visible_is_monotone_and_a_prefix_of_the_content(text):
    reader = ToolOutput(NAMES)
    parsed = reader.parse(text)
    last = 0
    for end in range(len(text) + 1):
        visible = reader.visible(text[:end])
        assert visible >= last
        last = visible
    assert text[:last] == parsed.content[:last]
    if parsed.calls:  # nothing of a call was sent as content
        assert "<tool_call>" not in text[:last] and "{" not in text[:last]


def test_visible_holds_partial_markers():
    reader = ToolOutput(NAMES)
    assert reader.visible("Hello <tool_") == len("Hello ")
    assert reader.visible("Hello <tool_x") == len("Hello <tool_x")
    assert reader.visible("  ") == 0 and reader.visible("{") == 0 and reader.visible("<|pyth") == 0
    assert reader.visible("Hi") == 2
