"""The router app in front of fake engines: where requests go, what passes through, errors and retries."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from kubelora.router.hashring import HashRing
from kubelora.router.placement import parse_placement
from kubelora.router.proxy import REPLICA_HEADER

from ..live_http import free_port
from .conftest import placement_text

pytestmark = pytest.mark.timeout(60)  # a relay bug shows as a hang: fail fast instead


def completion(model: str, stream: bool = False) -> dict:
    return {"model": model, "prompt": "hi", "max_tokens": 4, "stream": stream}


async def test_held_adapter_goes_to_its_holder(engines, router):
    client = await router(placement_text(engines, adapters={"a": ["p2"]}))
    for _ in range(3):
        response = await client.post("/v1/completions", json=completion("a"))
        assert response.status == 200 and response.headers[REPLICA_HEADER] == "p2"
        assert (await response.json())["engine"] == "p2"
    assert engines[2].seen == ["a", "a", "a"] and not engines[0].seen and not engines[1].seen


async def test_unheld_adapter_goes_to_its_hashed_home(engines, router):
    client = await router(placement_text(engines, adapters={"fresh": []}))
    home = HashRing(["p0", "p1", "p2"]).walk("fresh")[0]
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = await client.post(path, json=completion("fresh"))
        assert response.headers[REPLICA_HEADER] == home


async def test_unknown_model_is_404_naming_it(engines, router):
    client = await router(placement_text(engines, adapters={"a": []}))
    response = await client.post("/v1/completions", json=completion("tenant-x"))
    assert response.status == 404
    error = (await response.json())["error"]
    assert error["type"] == "not_found_error" and error["code"] == "model_not_found" and error["param"] == "model"
    assert "tenant-x" in error["message"]
    assert not any(e.seen for e in engines)


async def test_no_placement_or_no_ready_replica_is_503_with_retry_after(engines, router):
    client = await router(None)
    response = await client.post("/v1/completions", json=completion("base"))
    assert response.status == 503 and response.headers["Retry-After"] == "1"
    assert (await response.json())["error"]["code"] == "placement_not_loaded"
    assert (await client.get("/ready")).status == 503

    client = await router(placement_text(engines, ready=()))
    response = await client.post("/v1/completions", json=completion("base"))
    assert response.status == 503 and (await response.json())["error"]["code"] == "no_ready_replica"
    assert (await client.get("/ready")).status == 503


async def test_malformed_bodies_are_400(engines, router):
    client = await router(placement_text(engines))
    for body, code in ((b"{not json", "invalid_json"), (b"[1]", "invalid_type"), (b'{"prompt": "x"}', "missing_field")):
        response = await client.post("/v1/completions", data=body, headers={"Content-Type": "application/json"})
        assert response.status == 400 and (await response.json())["error"]["code"] == code
    response = await client.get("/v1/nothing")
    assert response.status == 404 and (await response.json())["error"]["type"] == "not_found_error"


async def test_base_model_avoids_the_busy_replicas(engines, router):
    client = await router(placement_text(engines))
    for engine in engines:
        engine.gate.clear()  # every answer waits: requests stay in flight
    held = [asyncio.create_task(client.post("/v1/completions", json=completion("base"))) for _ in range(2)]
    await _until(lambda: sum(len(e.seen) for e in engines) == 2)
    busy = {e.name for e in engines if e.seen}
    assert len(busy) == 2  # least loaded: the second request did not join the first
    third = asyncio.create_task(client.post("/v1/completions", json=completion("base")))
    await _until(lambda: sum(len(e.seen) for e in engines) == 3)
    for engine in engines:
        engine.gate.set()
    assert (await third).headers[REPLICA_HEADER] not in busy
    await asyncio.gather(*held)


async def test_hot_adapter_spills_over_to_its_other_holder(engines, router):
    client = await router(placement_text(engines, adapters={"hot": ["p0", "p1"]}), load_factor=1.0)
    home, other = HashRing(["p0", "p1"]).walk("hot")
    by_name = {e.name: e for e in engines}
    by_name[home].gate.clear()
    by_name[other].gate.clear()
    tasks = [asyncio.create_task(client.post("/v1/completions", json=completion("hot"))) for _ in range(4)]
    await _until(lambda: len(by_name[home].seen) + len(by_name[other].seen) == 4)
    assert len(by_name[home].seen) == 2 and len(by_name[other].seen) == 2  # load factor 1: even split
    assert not engines[2].seen  # never outside the holders while one of them has room
    by_name[home].gate.set()
    by_name[other].gate.set()
    await asyncio.gather(*tasks)


async def test_stream_passes_chunk_by_chunk(engines, router):
    client = await router(placement_text(engines, adapters={"a": ["p1"]}))
    engines[1].gate.clear()  # the engine sends one chunk, then waits
    response = await client.post("/v1/completions", json=completion("a", stream=True))
    assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
    first = await asyncio.wait_for(response.content.readuntil(b"\n\n"), 5)
    assert json.loads(first[len(b"data: "):])["choices"][0]["text"] == "0 "
    engines[1].gate.set()
    rest = await response.read()
    assert rest.endswith(b"data: [DONE]\n\n") and rest.count(b"data: ") == 3


async def test_client_disconnect_cancels_the_upstream_request(engines, router):
    client = await router(placement_text(engines, adapters={"a": ["p1"]}))
    engines[1].gate.clear()
    response = await client.post("/v1/completions", json=completion("a", stream=True))
    await response.content.readuntil(b"\n\n")
    assert client.state.in_flight.snapshot() == {"p1": 1}
    response.close()
    await _until(lambda: engines[1].cancelled == 1)
    await _until(lambda: client.state.in_flight.snapshot() == {})
    metrics = await (await client.get("/metrics")).text()
    # The client left; the replica did not fail: its count stays at 0.
    assert 'kubelora_router_upstream_errors_total{kind="broken",pod="p1"} 0.0' in metrics


async def test_client_timeout_cancels_a_non_streamed_upstream_request(engines, router):
    client = await router(placement_text(engines, adapters={"a": ["p2"]}))
    engines[2].gate.clear()
    with pytest.raises(asyncio.TimeoutError):
        await client.post("/v1/completions", json=completion("a"), timeout=aiohttp.ClientTimeout(total=0.5))
    await _until(lambda: engines[2].cancelled == 1)
    await _until(lambda: client.state.in_flight.snapshot() == {})


async def test_unreachable_replica_is_retried_on_the_next(engines, router):
    dead = {"pod": "dead", "url": f"http://127.0.0.1:{free_port()}", "ready": True}
    text = placement_text(engines, ready=["p0"], adapters={"a": ["dead"]}, extra_replicas=[dead])
    client = await router(text)
    response = await client.post("/v1/completions", json=completion("a"))
    assert response.status == 200 and response.headers[REPLICA_HEADER] == "p0"
    metrics = await (await client.get("/metrics")).text()
    assert 'kubelora_router_upstream_errors_total{kind="connect",pod="dead"} 1.0' in metrics
    assert "kubelora_router_retries_total 1.0" in metrics

    text = placement_text(engines, ready=[], extra_replicas=[dead, {**dead, "pod": "dead2"}])
    client.state.store.set(parse_placement(text))
    response = await client.post("/v1/completions", json=completion("base"))
    assert response.status == 502 and (await response.json())["error"]["code"] == "replica_unreachable"


async def test_replica_breaking_mid_stream_ends_the_stream_with_an_error_event(engines, router):
    engines[0].is_breaking = True
    client = await router(placement_text(engines, ready=["p0"]))
    response = await client.post("/v1/completions", json=completion("base", stream=True))
    assert response.status == 200
    events = (await response.read()).decode().strip().split("\n\n")
    assert json.loads(events[0][len("data: "):])["choices"][0]["text"] == "0 "
    error = json.loads(events[1][len("data: "):])["error"]
    assert error["type"] == "upstream_error" and error["code"] == "replica_broke_stream"
    assert events[2] == "data: [DONE]"
    metrics = await (await client.get("/metrics")).text()
    assert 'kubelora_router_upstream_errors_total{kind="broken",pod="p0"} 1.0' in metrics


async def test_replica_breaking_a_json_answer_breaks_the_client_connection(engines, router):
    engines[0].is_breaking = True
    client = await router(placement_text(engines, ready=["p0"]))
    response = await client.post("/v1/completions", json=completion("base"))
    with pytest.raises(aiohttp.ClientPayloadError):  # never a short body that looks complete
        await response.read()
    assert (await client.get("/health")).status == 200


async def test_request_headers_are_forwarded_once(engines, router):
    client = await router(placement_text(engines, ready=["p0"]))
    await client.post("/v1/completions", json=completion("base"),
                      headers={"authorization": "Bearer t", "accept-encoding": "gzip", "X-Request-Id": "r1"})
    [headers] = engines[0].headers
    assert headers.getall("Authorization") == ["Bearer t"] and headers.getall("Accept-Encoding") == ["gzip"]
    assert headers["X-Request-Id"] == "r1" and headers["X-Forwarded-For"] == "127.0.0.1"
    assert headers["Host"] == engines[0].url.removeprefix("http://")  # the replica's, not the router's


async def test_replica_errors_pass_through(engines, router):
    engines[0].status = 429
    client = await router(placement_text(engines, ready=["p0"]))
    response = await client.post("/v1/completions", json=completion("base"))
    assert response.status == 429 and response.headers["Retry-After"] == "3"
    assert (await response.json())["error"]["code"] == "queue_full"


async def test_models_probes_and_metrics(engines, router):
    client = await router(placement_text(engines, ready=["p0", "p1"], adapters={"b": [], "a": ["p1", "p2"]},
                                         revision=7))
    models = (await (await client.get("/v1/models")).json())["data"]
    assert [m["id"] for m in models] == ["base", "a", "b"]
    assert models[0]["parent"] is None and models[1]["parent"] == "base" and models[1]["replicas"] == ["p1"]
    assert (await client.get("/health")).status == 200
    ready = await client.get("/ready")
    assert ready.status == 200 and (await ready.json())["revision"] == 7
    await client.post("/v1/completions", json=completion("a"))
    await client.post("/v1/completions", json=completion("nope"))
    metrics = await (await client.get("/metrics")).text()
    for line in ('kubelora_router_requests_total{decision="holder",model="a",pod="p1"} 1.0',
                 'kubelora_router_rejected_requests_total{code="model_not_found"} 1.0',
                 "kubelora_router_placement_revision 7.0",
                 'kubelora_router_placement_replicas{ready="true"} 2.0',
                 'kubelora_router_placement_replicas{ready="false"} 1.0',
                 "kubelora_router_placement_adapters 2.0",
                 'kubelora_router_in_flight{pod="p0"} 0.0'):
        assert line in metrics, line


async def _until(predicate, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)

