"""Prefix caching through the OpenAI API: `usage.prompt_tokens_details.cached_tokens` in whole and streamed
responses, `cache_salt` in completions and chat (and its 400s), the hit counters on /metrics, and the switch."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

PROMPT = [1] + [(13 + 7 * j) % 480 + 10 for j in range(39)]  # 40 tokens: two full blocks of 16 are cached
NUM_CACHED = 32
MESSAGES = [{"role": "system", "content": "You answer about gardens, in short sentences, always politely."},
            {"role": "user", "content": "Which colors do the roses of the old garden have in spring and summer?"}]


def _cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def _counters(server) -> dict[tuple, float]:
    status, body = server.get("/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def test_a_second_request_reports_its_cached_prefix(material, live_server):
    server = live_server()
    server.load("a0", material.adapters["a0"])
    client = server.client()
    ask = dict(prompt=PROMPT, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    first = client.completions.create(model="a0", **ask)
    second = client.completions.create(model="a0", **ask)
    assert (_cached(first.usage), _cached(second.usage)) == (0, NUM_CACHED)
    assert second.choices[0].text == first.choices[0].text and second.usage.prompt_tokens == len(PROMPT)
    chunks = list(client.completions.create(model="a0", stream=True, stream_options={"include_usage": True}, **ask))
    assert chunks[-1].choices == [] and _cached(chunks[-1].usage) == NUM_CACHED
    base = server.serving.model_name
    assert _cached(client.completions.create(model=base, **ask).usage) == 0  # the adapter's blocks are its own

    counters = _counters(server)
    assert counters[("vllm:prefix_cache_queries_total", (("model_name", base),))] == 4 * len(PROMPT)
    assert counters[("vllm:prefix_cache_hits_total", (("model_name", base),))] == 2 * NUM_CACHED
    assert counters[("kubelora_prefix_cache_hits_total", (("adapter", "a0"),))] == 2 * NUM_CACHED
    assert counters[("kubelora_prefix_cache_queries_total", (("adapter", base),))] == len(PROMPT)
    assert counters[("kubelora_prefix_cache_hits_total", (("adapter", base),))] == 0


def test_chat_requests_share_within_a_cache_salt(live_server):
    server = live_server()
    client = server.client()
    base = server.serving.model_name

    def cached(salt: str | None, stream: bool = False) -> int:
        extra = {"ignore_eos": True} | ({"cache_salt": salt} if salt is not None else {})
        if not stream:
            return _cached(client.chat.completions.create(model=base, messages=MESSAGES, max_tokens=2, temperature=0,
                                                          extra_body=extra).usage)
        chunks = list(client.chat.completions.create(model=base, messages=MESSAGES, max_tokens=2, temperature=0,
                                                     stream=True, stream_options={"include_usage": True},
                                                     extra_body=extra))
        return _cached(chunks[-1].usage)

    assert cached("tenant-a") == 0 and cached("tenant-b") == 0 and cached(None) == 0
    assert cached("tenant-a") > 0 and cached("tenant-b", stream=True) > 0 and cached(None) > 0


def test_no_enable_prefix_caching_reports_no_cached_tokens(live_server):
    server = live_server(enable_prefix_caching=False)
    client = server.client()
    ask = dict(model=server.serving.model_name, prompt=PROMPT, max_tokens=2, temperature=0)
    assert [_cached(client.completions.create(**ask).usage) for _ in range(2)] == [0, 0]


@pytest.mark.parametrize("salt, code", [(7, "invalid_type"), ("", "invalid_value"), ("s" * 1025, "out_of_range"),
                                        (["a"], "invalid_type")])
async def test_a_bad_cache_salt_is_400(start_app, config_for, api_error, salt, code):
    client = await start_app(config_for())
    for path, body in (("/v1/completions", {"prompt": "hello"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]})):
        response = await client.post(path, json={"model": "model", "cache_salt": salt, **body})
        await api_error(response, 400, "invalid_request_error", param="cache_salt", code=code)


def test_the_switch_from_flags_and_environment():
    import argparse

    from kubelora.engine.server.config import add_arguments, resolve_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    required = ["--model", "/m", "--max-lora-rank", "16", "--max-cpu-loras", "4", "--max-model-len", "256"]
    assert resolve_config(parser.parse_args(required), {}).engine.enable_prefix_caching
    assert not resolve_config(parser.parse_args(required + ["--no-enable-prefix-caching"]), {}).engine \
        .enable_prefix_caching
    assert not resolve_config(parser.parse_args(required), {"KUBELORA_ENABLE_PREFIX_CACHING": "false"}).engine \
        .enable_prefix_caching
