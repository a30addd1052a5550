"""Every list and text a request carries is bounded (docs/server.md, "Request limits"): one past a limit is 400
`out_of_range` naming the field and the limit, one at the limit is accepted; lone surrogates decoded from a
field's own JSON (tool-call arguments, guided_json text) are 400 naming it."""

from __future__ import annotations

import json

import pytest

from kubelora.contract.errors import InvalidRequest
from kubelora.engine.server import chat_template, protocol, structured, tools
from kubelora.engine.server.app import LIFECYCLE
from kubelora.engine.server.protocol import parse_chat, parse_completion

COMPLETION = {"model": "m", "prompt": "Hello", "max_tokens": 4}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}


def _tool(i: int, description: str = "") -> dict:
    return {"type": "function", "function": {"name": f"f{i}", "description": description,
                                             "parameters": {"type": "object"}}}


def _kwargs(num_chars: int) -> dict:
    return {"chat_template_kwargs": {"note": "x" * (num_chars - len('{"note":""}'))}}


def _tools_of(num_chars: int) -> dict:
    base = len(json.dumps([{"type": "function", "function": {"name": "f0", "description": "",
                                                               "parameters": {"type": "object"}}}],
                          separators=(",", ":")))
    return {"tools": [_tool(0, "x" * (num_chars - base))]}


# field, (request at the limit, request one past it): the second is refused naming the field.
LIMITS = {
    "stop (count)": ("stop", lambda n: {"stop": ["s"] * n}, protocol.MAX_STOP_STRINGS),
    "stop (length)": ("stop", lambda n: {"stop": ["x" * n]}, protocol.MAX_STOP_CHARS),
    "bad_words (count)": ("bad_words", lambda n: {"bad_words": ["w"] * n}, protocol.MAX_BAD_WORDS),
    "bad_words (length)": ("bad_words", lambda n: {"bad_words": ["x" * n]}, protocol.MAX_BAD_WORD_CHARS),
    "stop_token_ids": ("stop_token_ids", lambda n: {"stop_token_ids": [1] * n}, protocol.MAX_STOP_TOKEN_IDS),
    "allowed_token_ids": ("allowed_token_ids", lambda n: {"allowed_token_ids": [1] * n},
                          protocol.MAX_ALLOWED_TOKEN_IDS),
    "logit_bias": ("logit_bias", lambda n: {"logit_bias": {str(i): 1 for i in range(n)}},
                   protocol.MAX_LOGIT_BIAS_ENTRIES),
    "n": ("n", lambda n: {"n": n}, protocol.MAX_PROMPTS),
    "messages": ("messages", lambda n: {"messages": [{"role": "user", "content": "x"}] * n}, protocol.MAX_MESSAGES),
    "tools (count)": ("tools", lambda n: {"tools": [_tool(i) for i in range(n)]}, tools.MAX_TOOLS),
    "tools (size)": ("tools", _tools_of, tools.MAX_TOOLS_CHARS),
    "chat_template_kwargs (count)": ("chat_template_kwargs",
                                     lambda n: {"chat_template_kwargs": {f"k{i}": 1 for i in range(n)}},
                                     chat_template.MAX_TEMPLATE_KWARGS),
    "chat_template_kwargs (size)": ("chat_template_kwargs", _kwargs, chat_template.MAX_TEMPLATE_KWARGS_CHARS),
    "guided_choice": ("guided_choice", lambda n: {"guided_choice": [f"c{i}" for i in range(n)]},
                      structured.MAX_CHOICES),
    "guided_regex (size)": ("guided_regex", lambda n: {"guided_regex": "a" * n}, structured.MAX_SPEC_CHARS),
}


@pytest.mark.parametrize("case", sorted(LIMITS))
def test_one_past_each_limit_is_400_naming_it(case):
    param, extra, limit = LIMITS[case]
    parse_chat({**CHAT, **extra(limit)})  # at the limit: accepted
    with pytest.raises(InvalidRequest) as caught:
        parse_chat({**CHAT, **extra(limit + 1)})
    assert caught.value.param == param and caught.value.code == "out_of_range", caught.value.message
    assert str(limit) in caught.value.message


def test_completion_prompts_are_bounded():
    parse_completion({**COMPLETION, "prompt": ["p"] * protocol.MAX_PROMPTS})
    with pytest.raises(InvalidRequest, match=str(protocol.MAX_PROMPTS)) as caught:
        parse_completion({**COMPLETION, "prompt": ["p"] * (protocol.MAX_PROMPTS + 1)})
    assert caught.value.param == "prompt"
    with pytest.raises(InvalidRequest) as caught:
        parse_completion({**COMPLETION, "best_of": 2})
    assert caught.value.param == "best_of" and caught.value.code == "unsupported_value"


ARGS_SURROGATE = json.dumps({"city": "\ud800"})  # the escape travels inside the arguments string
CALL = {"id": "c1", "type": "function", "function": {"name": "f0", "arguments": ARGS_SURROGATE}}


@pytest.mark.parametrize("extra, param", [
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [CALL]}]},
     "messages[1].tool_calls[0].function.arguments.city"),
    ({"guided_json": json.dumps({"type": "string", "enum": ["\udc00"]})}, "guided_json.enum[0]"),
    ({"stop": ["ok", "\ud800"]}, "stop"),
])
def test_surrogates_decoded_from_a_fields_json_are_400(extra, param):
    assert "\\ud" in json.dumps(extra)
    with pytest.raises(InvalidRequest, match="surrogate") as caught:
        parse_chat({**CHAT, **extra})
    assert caught.value.param == param and caught.value.code == "invalid_value"


def test_tool_call_arguments_nested_too_deeply_are_400():
    deep = "[" * 100 + "]" * 100
    call = {**CALL, "function": {"name": "f0", "arguments": json.dumps({"a": json.loads(deep)})}}
    with pytest.raises(InvalidRequest, match="nested too deeply"):
        parse_chat({**CHAT, "messages": [{"role": "assistant", "tool_calls": [call]}]})


@pytest.fixture
async def api(start_app, config_for):
    return await start_app(config_for())


@pytest.mark.parametrize("extra, param", [
    ({"chat_template_kwargs": {"k": "\ud800"}}, "chat_template_kwargs.k"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"description": "\udfff"}}}]},
     "tools[0].function.parameters.description"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [CALL]}]},
     "messages[1].tool_calls[0].function.arguments.city"),
])
async def test_surrogates_that_would_reach_the_template_are_400(api, api_error, extra, param):
    model = api.server.app[LIFECYCLE].serving.model_name
    response = await api.post("/v1/chat/completions", data=json.dumps({**CHAT, "model": model, **extra}))
    await api_error(response, 400, "invalid_request_error", param, "invalid_value")
    ok = await api.post("/v1/chat/completions", json={**CHAT, "model": model})
    assert ok.status == 200, await ok.text()
