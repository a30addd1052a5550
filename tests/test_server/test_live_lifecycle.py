"""Adapter lifecycle over HTTP while traffic flows: load while serving, in-place revisions during a stream,
unload during a stream, idempotent admin calls, `known` adapters loaded on demand, the admin token."""

from __future__ import annotations

import pytest

LONG = 200  # tokens: a stream long enough to still be running while the admin call happens
STEP_S = 0.005  # the engine's minimum step time in these tests: LONG tokens take at least one second
PROMPT = "Once upon a time"


def _stream(client, model: str, max_tokens: int = LONG):
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0, stream=True,
                                     extra_body={"ignore_eos": True})


def _running(server, adapter: str) -> int:
    return server.serving.engine.snapshot().num_running.get(adapter, 0)


def _greedy(client, model: str, max_tokens: int = 8) -> str:
    response = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                         extra_body={"ignore_eos": True})
    return response.choices[0].text


@pytest.fixture
def prompt_tokens(live_server):
    def encode(server) -> list[int]:
        return server.encode(PROMPT)
    return encode


def test_load_while_streaming(material, live_server, reference, prompt_tokens):
    server = live_server(min_step_s=STEP_S)
    server.load("a0", material.adapters["a0"])
    client = server.client()
    stream = _stream(client, "a0")
    first = next(iter(stream)).choices[0].text
    assert _running(server, "a0") == 1
    body = server.load("late", material.extra["late"])  # reads and validates while a0 keeps generating
    assert body["adapter"]["parent"] == server.serving.model_name and not body["was_loaded"]
    tokens = prompt_tokens(server)
    assert _greedy(client, "late") == reference("late", [tokens], 8)[0]
    text = first + "".join(chunk.choices[0].text for chunk in stream)
    assert text == reference("a0", [tokens], LONG)[0]


def test_inplace_revision_during_stream(material, live_server, reference, prompt_tokens):
    server = live_server(min_step_s=STEP_S)
    v1 = server.load("tenant", material.extra["rev1"])["adapter"]["revision"]
    client = server.client()
    stream = _stream(client, "tenant")
    first = next(iter(stream)).choices[0].text

    rev2 = {"lora_name": "tenant", "lora_path": str(material.extra["rev2"])}
    status, body = server.admin_post("/v1/load_lora_adapter", rev2)
    assert status == 409 and body["error"]["type"] == "conflict_error" and body["error"]["code"] == "adapter_exists"
    v2 = server.load("tenant", material.extra["rev2"], load_inplace=True)["adapter"]["revision"]
    assert v2 != v1 and _running(server, "tenant") == 1  # the stream is still running, on v1

    tokens = prompt_tokens(server)
    assert _greedy(client, "tenant") == reference("rev2", [tokens], 8)[0]
    text = first + "".join(chunk.choices[0].text for chunk in stream)
    assert text == reference("rev1", [tokens], LONG)[0]
    [card] = [m for m in client.models.list().data if m.id == "tenant"]
    assert card.revision == v2
    # Same name, same revision again: success, nothing changes.
    again = server.load("tenant", material.extra["rev2"], load_inplace=True)
    assert again["was_loaded"] and again["adapter"]["revision"] == v2


def test_unload_during_stream(material, live_server, reference, prompt_tokens):
    server = live_server(min_step_s=STEP_S)
    server.load("a1", material.adapters["a1"])
    client = server.client()
    stream = _stream(client, "a1")
    first = next(iter(stream)).choices[0].text

    status, body = server.admin_post("/v1/unload_lora_adapter", {"lora_name": "a1"})
    assert status == 200 and body["was_loaded"]
    assert _running(server, "a1") == 1
    assert "a1" not in [m.id for m in client.models.list().data]
    import openai

    with pytest.raises(openai.NotFoundError):
        _greedy(client, "a1")
    text = first + "".join(chunk.choices[0].text for chunk in stream)
    assert text == reference("a1", [prompt_tokens(server)], LONG)[0]

    adapters = server.serving.adapters
    assert adapters.get("a1") is None
    stats = adapters.stats()
    assert stats.pool_used_bytes == 0 and stats.host_bytes == 0  # device and host memory freed
    status, body = server.admin_post("/v1/unload_lora_adapter", {"lora_name": "a1"})
    assert status == 200 and not body["was_loaded"]  # idempotent


def test_known_adapter_loads_on_first_request(material, live_server, reference, prompt_tokens):
    server = live_server()
    card = server.load("a2", material.adapters["a2"], preload=False)["adapter"]
    assert card["residency"] == "known"
    client = server.client()
    assert _greedy(client, "a2") == reference("a2", [prompt_tokens(server)], 8)[0]
    [listed] = [m for m in client.models.list().data if m.id == "a2"]
    assert listed.residency == "device" and listed.parent == server.serving.model_name


def test_admin_token(material, live_server):
    server = live_server(admin_token="s3cret")
    body = {"lora_name": "a3", "lora_path": str(material.adapters["a3"])}
    for token in ("", "wrong"):  # no Authorization header, then a wrong token
        status, error = server.admin_post("/v1/load_lora_adapter", body, token=token)
        assert status == 401 and error["error"]["type"] == "authentication_error"
    assert server.admin_post("/v1/unload_lora_adapter", {"lora_name": "a3"}, token="wrong")[0] == 401
    assert server.admin_post("/v1/load_lora_adapter", body)[0] == 200
    # Inference and listing stay open on the serving port, which has no admin endpoints, token or not.
    assert "a3" in [m.id for m in server.client().models.list().data]
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        status, error = server.post(path, {"lora_name": "a3"}, token="s3cret")
        assert status == 404, error
    assert "a3" in [m.id for m in server.client().models.list().data]


def _wait_idle(server, timeout_s: float) -> float:
    import time

    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        snapshot = server.serving.engine.snapshot()
        if not snapshot.num_running and not snapshot.num_waiting:
            return time.monotonic() - started
        time.sleep(0.02)
    raise AssertionError(f"requests still in flight after {timeout_s}s")


def test_client_disconnect_aborts(live_server):
    """450 tokens take over two seconds; a client that leaves frees its sequence within a step or two."""
    import openai

    server = live_server(min_step_s=STEP_S)
    base = server.serving.model_name
    stream = _stream(server.client(), base, max_tokens=450)
    next(iter(stream))
    stream.close()
    _wait_idle(server, 1.5)
    with pytest.raises(openai.APITimeoutError):
        server.client(timeout=0.5).completions.create(model=base, prompt=PROMPT, max_tokens=450,
                                                      extra_body={"ignore_eos": True})
    _wait_idle(server, 1.5)
    import time

    deadline = time.monotonic() + 2  # the engine is idle; the loop may not have delivered the last output yet
    while time.monotonic() < deadline and _aborted(server, base) < 2:
        time.sleep(0.02)
    assert _aborted(server, base) == 2


def _aborted(server, adapter: str) -> float:
    value = server.serving.metrics.registry.get_sample_value(
        "kubelora_requests_total", {"adapter": adapter, "finish_reason": "abort"})
    return value or 0
