"""Chat tools: `tools`, `tool_choice` and tool messages rendered through chat templates written here in the
Hermes/Qwen (`<tool_call>` tags) and Llama 3 (bare JSON) formats; `tool_calls` read back from the output,
whole and streamed, through a real server with the openai SDK. The model is random, so the live calls use an
engine whose output text is scripted (tokens, lengths and finish reasons stay the engine's own)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from kubelora.contract.errors import InvalidRequest
from kubelora.engine.server.chat_template import render_text
from kubelora.engine.server.protocol import parse_chat

HERMES_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}<|system|>Tools:\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|end|>{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|user|><tool_response id={{ message.tool_call_id }}>{{ message.content }}"
    "</tool_response><|end|>"
    "{%- elif message.role == 'assistant' and message.tool_calls %}<|assistant|>{{ message.content or '' }}"
    "{%- for call in message.tool_calls %}<tool_call>"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}</tool_call>{% endfor %}"
    "<|end|>"
    "{%- else %}<|{{ message.role }}|>{{ message.content }}<|end|>{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% if think is defined and not think %}/no_think{% endif %}"
    "{% endif %}"
)
LLAMA_JSON_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}<|system|>Answer a call as {\"name\": function name, \"parameters\": object}. Functions:\n"
    "{% for tool in tools %}{{ tool.function | tojson }}\n{% endfor %}<|end|>{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|user|>[ipython] {{ message.content }}<|end|>"
    "{%- elif message.tool_calls %}<|assistant|>{% for call in message.tool_calls %}"
    "{{ {'name': call.function.name, 'parameters': call.function.arguments} | tojson }}{% endfor %}<|end|>"
    "{%- else %}<|{{ message.role }}|>{{ message.content }}<|end|>{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def write_model(src, dst, template: str):
    """A copy of the tiny model whose tokenizer carries `template` (both places transformers reads it from)."""
    shutil.copytree(src, dst)
    (dst / "chat_template.jinja").write_text(template)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def models(material, tmp_path_factory):
    root = tmp_path_factory.mktemp("tool-models")
    return {"hermes": write_model(material.model_dir, root / "hermes", HERMES_TEMPLATE),
            "llama": write_model(material.model_dir, root / "llama", LLAMA_JSON_TEMPLATE)}


def _render(model_dir, body: dict) -> str:
    from transformers import AutoTokenizer

    req = parse_chat({"model": "m", **body})
    return render_text(AutoTokenizer.from_pretrained(model_dir), req.messages, req.add_generation_prompt,
                       req.template)


def test_hermes_template_renders_tools_and_tool_messages(models):
    text = _render(models["hermes"], {"messages": CONVERSATION, "tools": [WEATHER]})
    assert text == (
        "<s><|system|>Tools:\n" + json.dumps(WEATHER) + "\nCall one as <tool_call>{\"name\": ..., \"arguments\": "
        "{...}}</tool_call><|end|><|user|>Weather in Paris?<|end|><|assistant|><tool_call>{\"name\": "
        "\"get_weather\", \"arguments\": {\"city\": \"Paris\"}}</tool_call><|end|><|user|><tool_response id=call_1>"
        "sunny</tool_response><|end|><|assistant|>")


def test_llama_template_renders_bare_json_calls(models):
    text = _render(models["llama"], {"messages": CONVERSATION, "tools": [WEATHER, SEARCH], "tool_choice": "auto"})
    assert json.dumps(WEATHER["function"]) + "\n" + json.dumps(SEARCH["function"]) in text
    assert '<|assistant|>{"name": "get_weather", "parameters": {"city": "Paris"}}<|end|>' in text
    assert text.endswith("<|user|>[ipython] sunny<|end|><|assistant|>")


def test_no_tools_renders_as_before(models):
    assert _render(models["hermes"], {"messages": [{"role": "user", "content": "hi"}]}) == \
        "<s><|user|>hi<|end|><|assistant|>"


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0].type"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER] * 129}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": "{}"}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "x", "extra": 1}}]}, "tools[0].function.extra"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "search"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": 3}, "tool_choice"),
])
def test_tool_fields_refused(extra, param):
    with pytest.raises(InvalidRequest) as info:
        parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], **extra})
    assert info.value.param == param


@pytest.mark.parametrize("message, param", [
    ({"role": "tool", "content": "x"}, "messages[0].tool_call_id"),
    ({"role": "user", "content": "x", "tool_call_id": "c"}, "messages[0].tool_call_id"),
    ({"role": "user", "content": "x", "tool_calls": [CONVERSATION[1]["tool_calls"][0]]}, "messages[0].tool_calls"),
    ({"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]},
     "messages[0].tool_calls[0].id"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"role": "assistant"}, "messages[0].content"),
])
def test_tool_messages_refused(message, param):
    with pytest.raises(InvalidRequest) as info:
        parse_chat({"model": "m", "messages": [message]})
    assert info.value.param == param


class ScriptedEngine:
    """A real engine whose output text is `script["text"]`, revealed 4 characters per generated token and
    whole once the request finishes."""

    def __init__(self, engine, script: dict) -> None:
        self._engine = engine
        self._script = script

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self):
        text = self._script["text"]
        return [dataclasses.replace(o, text=text if o.finished else text[:4 * len(o.token_ids)])
                for o in self._engine.step()]


@pytest.fixture
def scripted(models, live_server, monkeypatch):
    """`scripted(kind)` -> (server, script): a live server of the `kind` template whose text is script["text"]."""
    from kubelora.engine.server import app

    script = {"text": ""}
    build = app.build_engine
    monkeypatch.setattr(app, "build_engine", lambda config: ScriptedEngine(build(config), script))
    return lambda kind: (live_server(model_dir=str(models[kind])), script)


def _ask(server, **extra):
    return server.client().chat.completions.create(
        model=server.serving.model_name, messages=[{"role": "user", "content": "Weather in Paris?"}],
        max_tokens=40, temperature=0, extra_body={"ignore_eos": True}, **extra)


HERMES_OUTPUT = ('Checking.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
                 '<tool_call>{"name": "search", "arguments": {"q": "paris weather"}}</tool_call>')


def test_live_hermes_tool_calls(scripted):
    server, script = scripted("hermes")
    script["text"] = HERMES_OUTPUT
    response = _ask(server, tools=[WEATHER, SEARCH])
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "get_weather", {"city": "Paris"}), ("function", "search", {"q": "paris weather"})]
    assert len({c.id for c in calls}) == 2
    # The tools reached the template: the prompt is longer than without them.
    assert response.usage.prompt_tokens > _ask(server).usage.prompt_tokens
    # tool_choice "none": the text is left as it is.
    plain = _ask(server, tools=[WEATHER, SEARCH], tool_choice="none").choices[0]
    assert plain.message.content == HERMES_OUTPUT and not plain.message.tool_calls
    assert plain.finish_reason == "length"


def test_live_hermes_tool_calls_streamed(scripted):
    server, script = scripted("hermes")
    script["text"] = HERMES_OUTPUT
    chunks = list(_ask(server, tools=[WEATHER, SEARCH], stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert content == "Checking.\n"  # no part of a call leaked as content
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
        (0, "get_weather", {"city": "Paris"}), (1, "search", {"q": "paris weather"})]
    assert all(d.id and d.type == "function" for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_live_llama_json_call_and_tool_round_trip(scripted):
    server, script = scripted("llama")
    script["text"] = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    client = server.client()
    first = client.chat.completions.create(model=server.serving.model_name, messages=CONVERSATION[:1],
                                           tools=[WEATHER], max_tokens=40, extra_body={"ignore_eos": True})
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls" and first.choices[0].message.content is None
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    # The SDK's own message objects go back as the conversation: assistant tool_calls, then the tool's answer.
    script["text"] = "It is sunny in Paris."
    messages = [*CONVERSATION[:1], first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    second = client.chat.completions.create(model=server.serving.model_name, messages=messages, tools=[WEATHER],
                                            max_tokens=20, extra_body={"ignore_eos": True})
    assert second.choices[0].message.content == "It is sunny in Paris." and not second.choices[0].message.tool_calls
    assert second.choices[0].finish_reason == "length"


def test_live_named_tool_choice_and_errors(scripted):
    import openai

    server, script = scripted("hermes")
    script["text"] = '{"city": "Lima"}'
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = _ask(server, tools=[WEATHER, SEARCH], tool_choice=named).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert (choice.message.tool_calls[0].function.name, json.loads(choice.message.tool_calls[0].function.arguments)) \
        == ("get_weather", {"city": "Lima"})
    with pytest.raises(openai.BadRequestError) as info:
        _ask(server, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert info.value.body["param"] == "tool_choice.function.name"
    assert info.value.body["type"] == "invalid_request_error"
