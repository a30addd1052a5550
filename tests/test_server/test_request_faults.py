"""Sampling parameters that once stopped the engine thread are served (or refused with a 400 naming the field),
concurrently with other requests, and /health stays up (aiohttp test client over the tiny model)."""

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
