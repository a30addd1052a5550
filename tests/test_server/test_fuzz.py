"""Bounded fuzzing of the OpenAI routes: random and mutated requests drawn from the openai SDK's own request types
(completions and chat completions), plus the hostile fields of the request limits, against a live server over
the tiny model. Throughout: no 5xx, the engine keeps running, `/health` answers within 1 s (polled from another
process), and a plain greedy request gets the same answer before, during and after.

Fixed seed (derandomize), no example database, no shrinking: every run draws the same sequence of requests, and
sends them for FUZZ_SECONDS (how far into the sequence that gets depends on the machine; about 4000 requests on
2 shared cores), which fits a CI budget.
"""

from __future__ import annotations

import collections
import collections.abc
import json
import time
import types
import typing

import typing_extensions
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from kubelora.engine.structured.compile_pool import CompileLimits

from ..live_http import HealthProbe, post

FUZZ_SECONDS = 60.0
MAX_EXAMPLES = 5000
MAX_HEALTH_S = 1.0
MAX_FUZZ_TOKENS = 8  # generation is cut to this: the run measures the edge, not the model
HOSTILE_PATTERN = "^(([a-z0-9]{1,20}){1,20}){1,20}$"  # compiles for seconds: past the fuzz run's deadline
SURROGATE = "a\ud800b"


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps({"x": SURROGATE})}}

COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "stop", "seed", "stream",
                     "stream_options", "n", "logprobs", "echo", "presence_penalty", "frequency_penalty",
                     "logit_bias", "user", "best_of", "suffix"}
CHAT_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "seed",
               "stream", "stream_options", "n", "logprobs", "top_logprobs", "presence_penalty",
               "frequency_penalty", "logit_bias", "user", "tools", "tool_choice", "parallel_tool_calls",
               "response_format"}

VALID_COMPLETION = {"prompt": "Once upon a time", "max_tokens": MAX_FUZZ_TOKENS}
VALID_CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": MAX_FUZZ_TOKENS}
HOSTILE_FIELDS = [
    {"chat_template_kwargs": {"k": SURROGATE}},
    {"chat_template_kwargs": {"k": _nested(70)}},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"description": SURROGATE}}}]},
    {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [CALL]}]},
    {"stop": ["s" * 2000]},
    {"stop": [SURROGATE]},
    {"bad_words": ["w" * 300] * 64},
    {"bad_words": [f"w{i}" for i in range(65)]},
    {"logit_bias": {str(i): 1 for i in range(1025)}},
    {"logit_bias": {"99999999": 1}},
    {"allowed_token_ids": list(range(65537))},
    {"allowed_token_ids": [10**9]},
    {"stop_token_ids": list(range(257))},
    {"n": 65},
    {"best_of": 2},
    {"temperature": float("nan")},
    {"top_p": float("inf")},
    {"guided_regex": HOSTILE_PATTERN},
    {"response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "string", "pattern": HOSTILE_PATTERN}}}},
    {"guided_json": '{"type": "string", "enum": ["\\ud800"]}'},
    {"guided_choice": []},
    {"structured_outputs": {"regex": "[", "choice": ["a"]}},
    {"prompt": [10**9]},
    {"prompt": [[1, 2], "text", [3]]},
    {"messages": [{"role": "user", "content": "x"}] * 4097},
    {"truncate_prompt_tokens": 0},
    {"min_tokens": 10**6},
    {"continue_final_message": True, "add_generation_prompt": True},
]


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats() | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=8)
SEQUENCES = {list, tuple, set, frozenset, collections.abc.Iterable, collections.abc.Sequence}
WRAPPERS = {typing.Annotated, typing.Required, typing.NotRequired, typing_extensions.Required,
            typing_extensions.NotRequired}
# What a mutation puts in place of a field's value.
MUTANTS = [SURROGATE, _nested(70), 10**30, -1, 0, "", [], {}, None, True, float("nan"), "x" * 5000, [SURROGATE]]


def strategy_for(hint, depth: int = 0) -> st.SearchStrategy:
    """Values of a type of the openai SDK's request params (TypedDicts of literals, unions, lists and dicts),
    small: hypothesis's own `from_type` draws iterables and objects too large to send in the time budget."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if depth > 6 or hint is type(None):
        return st.none()
    leaf = {str: st.text(max_size=24), bool: st.booleans(), int: st.integers(-2**40, 2**40) | st.integers(-2, 70),
            float: st.floats() | st.floats(-3, 3), object: JSON, typing.Any: JSON}.get(hint)
    if leaf is not None:
        return leaf
    if origin in (typing.Literal, typing_extensions.Literal):
        return st.sampled_from(args)
    if origin in (typing.Union, types.UnionType):
        return st.one_of([strategy_for(a, depth) for a in args])
    if origin in WRAPPERS:
        return strategy_for(args[0], depth)
    if origin in SEQUENCES:
        return st.lists(strategy_for(args[0], depth + 1) if args else JSON, max_size=4)
    if origin in (dict, collections.abc.Mapping):
        return st.dictionaries(st.text(max_size=8), strategy_for(args[1], depth + 1), max_size=4)
    if typing_extensions.is_typeddict(hint):
        fields = {k: strategy_for(v, depth + 1) for k, v in typing.get_type_hints(hint).items()}
        return st.fixed_dictionaries({k: fields[k] for k in hint.__required_keys__},
                                     optional={k: fields[k] for k in hint.__optional_keys__})
    raise TypeError(f"no strategy for {hint!r}")


CHAT_PARAMS = strategy_for(chat_params.CompletionCreateParamsBase)
COMPLETION_PARAMS = strategy_for(completion_params.CompletionCreateParamsBase)


def _short(body: dict) -> dict:
    for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
        if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > MAX_FUZZ_TOKENS:
            body[key] = MAX_FUZZ_TOKENS
    return body


@st.composite
def requests(draw, model: str) -> tuple[str, dict]:
    is_chat = draw(st.booleans())
    drawn = draw(CHAT_PARAMS if is_chat else COMPLETION_PARAMS)
    if draw(st.integers(0, 3)) > 0:  # mostly a valid request with a few drawn fields the server knows
        known = sorted(set(drawn) & (CHAT_FIELDS if is_chat else COMPLETION_FIELDS))
        keep = draw(st.lists(st.sampled_from(known), max_size=2, unique=True)) if known else []
        drawn = {**(VALID_CHAT if is_chat else VALID_COMPLETION), **{k: drawn[k] for k in keep}}
    if draw(st.integers(0, 4)) > 0:
        drawn["model"] = model
    if draw(st.integers(0, 2)) == 0:
        drawn.update(draw(st.sampled_from(HOSTILE_FIELDS)))
    if drawn and draw(st.integers(0, 4)) == 0:
        drawn[draw(st.sampled_from(sorted(drawn)))] = draw(st.sampled_from(MUTANTS))
    if "max_tokens" not in drawn and draw(st.integers(0, 9)) > 0:
        drawn["max_tokens"] = MAX_FUZZ_TOKENS
    return ("/v1/chat/completions" if is_chat else "/v1/completions"), _short(drawn)


def test_fuzzed_requests_never_5xx_nor_stall_the_server(live_server, monkeypatch):
    server = live_server()
    monkeypatch.setattr(server.serving.engine.grammars.pool, "limits", CompileLimits(timeout_s=1.0))
    model = server.serving.model_name
    victim = json.dumps({"model": model, "prompt": "The victim asks", "max_tokens": 8, "temperature": 0}).encode()
    status, answer, _ = post(server.url + "/v1/completions", victim)
    assert status == 200, answer
    expected = json.loads(answer)["choices"][0]["text"]
    deadline = time.monotonic() + FUZZ_SECONDS
    statuses: collections.Counter = collections.Counter()

    @settings(derandomize=True, database=None, deadline=None, max_examples=MAX_EXAMPLES,
              phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))
    @given(requests(model))
    def one(drawn: tuple[str, dict]) -> None:
        if time.monotonic() > deadline:
            return
        path, body = drawn
        status, answer, _ = post(server.url + path, json.dumps(body).encode())
        statuses[status] += 1
        assert status < 500, (path, body, answer[:2000])
        assert b"server_error" not in answer, (path, body, answer[:2000])
        assert server.serving.engine.failure is None and server.serving.engine.is_running
        if statuses.total() % 25 == 0:
            assert json.loads(post(server.url + "/v1/completions", victim)[1])["choices"][0]["text"] == expected

    with HealthProbe(server.url, interval_s=0.05, min_probes=20) as probe:
        one()
    # Most drawn requests are refused somewhere (a drawn temperature of 1e300); a tenth must be served, or the run
    # would test parsing only.
    assert statuses.total() >= 200 and statuses[200] >= statuses.total() // 10, statuses
    assert probe.worst_s < MAX_HEALTH_S, sorted(probe.latencies)[-5:]
    status, answer, _ = post(server.url + "/v1/completions", victim)
    assert status == 200 and json.loads(answer)["choices"][0]["text"] == expected
