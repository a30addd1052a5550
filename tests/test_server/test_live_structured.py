"""Structured output through a real server with the openai SDK: response_format json_object / json_schema
(chat and completions), vLLM's structured_outputs and the guided_* aliases, streamed too; invalid schemas,
regexes and grammars are 400 naming their field; compilation never runs on the event loop."""

from __future__ import annotations

import json
import re
import threading

import pytest

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,10}$"},
                   "days": {"type": "integer", "minimum": 1, "maximum": 30},
                   "mode": {"enum": ["train", "car"]}},
    "required": ["city", "days", "mode"],
    "additionalProperties": False,
}
EMAIL = r"[a-z]{2,6}@[a-z]{3}\.(com|org)"
MESSAGES = [{"role": "user", "content": "Plan a trip."}]


@pytest.fixture
def server(live_server):
    return live_server()


def _check_trip(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"city", "days", "mode"} and re.fullmatch("[A-Za-z]{1,10}", value["city"])
    assert isinstance(value["days"], int) and 1 <= value["days"] <= 30 and value["mode"] in ("train", "car")


def test_chat_response_format_json_schema_and_object(server):
    client = server.client()
    model = server.serving.model_name
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}}
    for temperature in (0, 1):
        response = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=80, n=3, seed=2,
                                                  temperature=temperature, response_format=fmt)
        for choice in response.choices:
            assert choice.finish_reason == "stop"
            _check_trip(choice.message.content)
    response = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=200, temperature=0,
                                              response_format={"type": "json_object"})
    assert response.choices[0].message.content.startswith("{")
    if response.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(response.choices[0].message.content), dict)


def test_completions_structured_outputs_and_guided_aliases(server):
    client = server.client()
    model = server.serving.model_name
    cases = [({"structured_outputs": {"regex": EMAIL}}, lambda t: re.fullmatch(EMAIL, t)),
             ({"guided_regex": EMAIL}, lambda t: re.fullmatch(EMAIL, t)),
             ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
             ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
             ({"structured_outputs": {"json": SCHEMA}}, _check_trip),
             ({"guided_json": json.dumps(SCHEMA)}, _check_trip),
             ({"structured_outputs": {"grammar": 'root ::= "v" [0-9] "." [0-9]'}}, lambda t: re.fullmatch(r"v\d\.\d", t)),
             ({"guided_grammar": 'root ::= "v" [0-9] "." [0-9]'}, lambda t: re.fullmatch(r"v\d\.\d", t))]
    for extra, check in cases:
        response = client.completions.create(model=model, prompt="Answer:", max_tokens=80, temperature=1, seed=5,
                                             extra_body=extra)
        choice = response.choices[0]
        assert choice.finish_reason == "stop", (extra, choice.text)
        assert check(choice.text) is not False, (extra, choice.text)
    response = client.completions.create(model=model, prompt="Answer:", max_tokens=80, temperature=0,
                                         extra_body={"response_format": {"type": "json_schema",
                                                                         "json_schema": {"name": "t", "schema": SCHEMA}}})
    _check_trip(response.choices[0].text)


def test_streamed_structured_output(server):
    client = server.client()
    stream = client.chat.completions.create(model=server.serving.model_name, messages=MESSAGES, max_tokens=80,
                                            temperature=1, seed=3, stream=True,
                                            extra_body={"guided_json": SCHEMA})
    parts, reasons = [], []
    for chunk in stream:
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert reasons[-1] == "stop"
    _check_trip("".join(parts))


@pytest.mark.parametrize(("extra", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": [1, 2]}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
])
def test_invalid_constraints_are_400_naming_the_field(server, extra, param):
    body = {"model": server.serving.model_name, "messages": MESSAGES, "max_tokens": 4, **extra}
    status, answer = server.post("/v1/chat/completions", body)
    assert status == 400 and answer["error"]["param"] == param, answer
    assert answer["error"]["type"] == "invalid_request_error" and param in answer["error"]["message"], answer


def test_compilation_runs_on_the_grammar_pool(server):
    grammars = server.serving.engine.grammars
    compile_, threads = grammars.compile, []

    def recording(spec):
        threads.append(threading.current_thread().name)
        return compile_(spec)

    grammars.compile = recording
    client = server.client()
    for pattern in ("[ab]{3}", "[cd]{2}", "[ab]{3}"):
        response = client.completions.create(model=server.serving.model_name, prompt="x", max_tokens=8,
                                             extra_body={"guided_regex": pattern})
        assert re.fullmatch(pattern, response.choices[0].text)
    # The repeated pattern comes from the cache without a compile.
    assert len(threads) == 2 and all(name.startswith("kubelora-grammar") for name in threads), threads
