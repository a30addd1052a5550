"""Sampling parameters that once stopped the engine thread are served (or refused with a 400 naming the field),
concurrently with other requests, and /health stays up; a request the engine fails alone gets the answer of its
cause: 422 for logits that are not finite (an adapter with NaN weights) or parameters that leave no token, 500
for an exception in the engine's work for it, whole or streamed (aiohttp test client over the tiny model)."""

from __future__ import annotations

import asyncio

COMPLETION = {"model": "model", "prompt": [8, 9, 10, 11], "max_tokens": 4}


async def test_sampling_faults_are_served_and_health_stays_up(start_app, config_for, api_error):
    client = await start_app(config_for())
    allowed = [300, 301, 302]
    requests = [
        {**COMPLETION, "n": 2, "temperature": 1.0, "allowed_token_ids": allowed},
        {**COMPLETION, "temperature": 1e-40, "logprobs": 0},
        {**COMPLETION, "temperature": 0.0, "logprobs": 0},
        {**COMPLETION, "prompt": [12, 13], "n": 2, "temperature": 0.0, "allowed_token_ids": [400, 7, 400]},
    ]
    responses = await asyncio.gather(*(client.post("/v1/completions", json=body) for body in requests))
    bodies = [await r.json() for r in responses]
    assert [r.status for r in responses] == [200] * 4, bodies
    assert len(bodies[0]["choices"]) == 2
    assert all(choice["finish_reason"] == "length" for body in bodies for choice in body["choices"])
    tiny, zero = bodies[1]["choices"][0], bodies[2]["choices"][0]
    assert tiny["text"] == zero["text"] and tiny["logprobs"]["tokens"] == zero["logprobs"]["tokens"]  # greedy
    assert (await client.get("/health")).status == 200

    refused = await client.post("/v1/completions", json={**COMPLETION, "temperature": 1.0,
                                                          "repetition_penalty": 1e-40})
    error = await api_error(refused, 400, "invalid_request_error", param="repetition_penalty")
    assert "[0.01, 2]" in error["message"]
    again = await client.post("/v1/completions", json={**COMPLETION, "n": 2, "allowed_token_ids": allowed})
    assert again.status == 200 and (await client.get("/health")).status == 200


# ---- requests the engine fails get the answer of their cause ----

def capturing_factory(engines: list):
    """An engine factory for build_app that keeps the LLMEngine it builds in `engines`."""
    from kubelora.engine.server.app import build_engine

    def build(config):
        engines.append(build_engine(config))
        return engines[-1]

    return build


def poison_adapter(engine, name: str) -> None:
    """Make adapter `name` resident and set its pool rows to NaN (loads refuse such weights; the pool's test hook
    puts them there). Called while the engine is idle: the engine thread touches the pool only in its steps."""
    from kubelora.engine.adapters.types import Residency

    revision = engine.adapters.acquire(name)
    try:
        assert engine.adapters.ensure_device(revision, set()) is Residency.RESIDENT
        engine.adapters._pool.fill(revision.id, float("nan"))
    finally:
        engine.adapters.release(revision)


def sse_events(text: str) -> list:
    import json

    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


async def test_non_finite_logits_are_422_and_other_requests_are_served(start_app, config_for, material, api_error):
    engines: list = []
    client = await start_app(config_for(), capturing_factory(engines))
    load = {"lora_name": "nan", "lora_path": str(material.adapters["a1"])}
    assert (await client.admin.post("/v1/load_lora_adapter", json=load)).status == 200
    greedy = {**COMPLETION, "temperature": 0.0}
    clean = await (await client.post("/v1/completions", json=greedy)).json()
    poison_adapter(engines[0], "nan")

    responses = await asyncio.gather(client.post("/v1/completions", json={**greedy, "model": "nan"}),
                                     client.post("/v1/completions", json=greedy))
    error = await api_error(responses[0], 422, "invalid_request_error", param="model", code="non_finite_logits")
    assert "not finite" in error["message"]
    assert responses[1].status == 200 and (await responses[1].json())["choices"] == clean["choices"]

    stream = await client.post("/v1/completions", json={**COMPLETION, "model": "nan", "stream": True})
    text = await stream.text()
    assert stream.status == 200 and text.endswith("data: [DONE]\n\n")
    [event] = sse_events(text)
    assert (event["error"]["type"], event["error"]["code"]) == ("invalid_request_error", "non_finite_logits")
    assert (await client.get("/health")).status == 200


async def test_parameters_that_leave_no_token_are_422(start_app, config_for, api_error):
    engines: list = []
    client = await start_app(config_for(), capturing_factory(engines))
    eos = engines[0].eos_token_ids[0]  # allowed alone while min_tokens bans it: no token is left
    body = {**COMPLETION, "temperature": 0.7, "min_tokens": 2, "allowed_token_ids": [eos]}
    error = await api_error(await client.post("/v1/completions", json=body), 422, "invalid_request_error",
                            code="no_token_left")
    assert "no token is left" in error["message"]


async def test_an_exception_confined_to_one_request_is_500_and_the_engine_goes_on(start_app, config_for, api_error):
    engines: list = []
    client = await start_app(config_for(), capturing_factory(engines))
    runner, poisoned_prompt = engines[0]._runner, [7, 7, 7, 7]
    forward = runner.forward

    def broken(batch, previous=None):  # a bug one request's state triggers, in the engine thread
        if any(c.seq.prompt_token_ids == poisoned_prompt for c in batch.chunks):
            raise IndexError("a bug that one request's state triggers")
        return forward(batch, previous)

    runner.forward = broken
    responses = await asyncio.gather(client.post("/v1/completions", json={**COMPLETION, "prompt": poisoned_prompt}),
                                     client.post("/v1/completions", json=COMPLETION))
    error = await api_error(responses[0], 500, "server_error", code="engine_fault")
    assert "IndexError" in error["message"] and "one request's state" not in error["message"]
    assert responses[1].status == 200
    stream = await client.post("/v1/chat/completions", json={
        "model": "model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True})
    assert stream.status == 200 and not any("error" in e for e in sse_events(await stream.text()))
    assert (await client.get("/health")).status == 200
