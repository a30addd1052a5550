"""Ready means routable, stale placement: the operator's ack endpoint, a nudged read, the placement's
age in /ready and /metrics, and retries through every replica of a stale view."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from kubelora.router.app import STATE, build_app
from kubelora.router.config import RouterConfig
from kubelora.router.proxy import REPLICA_HEADER
from kubelora.router.sources import FileSource, PlacementStore

from ..live_http import free_port
from .conftest import placement_text

pytestmark = pytest.mark.timeout(60)



@pytest.fixture
async def file_router(aiohttp_client, tmp_path):
    """`await file_router(text, **config)` -> a test client of a router polling a placement file."""

    async def start(text: str, **overrides):
        path = tmp_path / "placement.json"
        path.write_text(text)
        config = RouterConfig(**{"placement_file": str(path), **overrides})
        client = await aiohttp_client(build_app(config, PlacementStore(), FileSource(str(path),
                                                                                     config.poll_interval)))
        client.path = path
        await _until(lambda: client.app[STATE].store.placement is not None)
        return client

    return start


async def _until(check, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_placement_answers_its_revision_and_a_nudge_reads_at_once(engines, file_router):
    client = await file_router(placement_text(engines, revision=1), poll_interval=30.0)
    ack = await (await client.get("/placement")).json()
    assert ack["revision"] == 1 and ack["lastError"] is None and 0 <= ack["ageSeconds"] < 5
    client.path.write_text(placement_text(engines, revision=2, adapters={"a": ["p1"]}))
    assert (await (await client.get("/placement")).json())["revision"] == 1  # no wait asked: the poll is 30 s away
    started = time.monotonic()
    ack = await (await client.get("/placement?min_revision=2&wait=5")).json()
    assert ack["revision"] == 2 and time.monotonic() - started < 1.0  # read now, not at the next poll
    response = await client.post("/v1/completions", json={"model": "a", "prompt": "hi", "max_tokens": 2})
    assert response.status == 200 and response.headers[REPLICA_HEADER] == "p1"
    # A revision that is not there: the nudged read finds the same file, and the wait ends after `wait`.
    started = time.monotonic()
    ack = await (await client.get("/placement?min_revision=3&wait=0.3")).json()
    assert ack["revision"] == 2 and 0.25 < time.monotonic() - started < 2.0


@pytest.mark.parametrize("query", ["min_revision=x", "wait=-1", "wait=11", "wait=nan", "min_revision=1.5"])
async def test_placement_query_errors_are_400(engines, router, query):
    client = await router(placement_text(engines))
    response = await client.get(f"/placement?{query}")
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["code"] == "invalid_value" and error["param"] in query


async def test_unreadable_placement_ages_and_ready_fails_after_the_max_age(engines, file_router, caplog):
    caplog.set_level(logging.INFO, logger="kubelora.router")
    client = await file_router(placement_text(engines, revision=4), poll_interval=0.1, max_placement_age=0.6)
    assert (await client.get("/ready")).status == 200
    client.path.unlink()  # the placement can no longer be read (a lost token mount, RBAC removed)
    ack = await (await client.get("/placement?min_revision=5&wait=5")).json()  # a failed read ends the wait
    assert ack["revision"] == 4 and "No such file" in ack["lastError"]
    response = await client.get("/ready")
    assert response.status == 200  # a short outage keeps the router routing on what it has
    await asyncio.sleep(0.7)
    response = await client.get("/ready")
    error = (await response.json())["error"]
    assert response.status == 503 and error["code"] == "placement_stale" and "revision 4" in error["message"]
    await client.get("/ready")
    assert [r.getMessage() for r in caplog.records].count("placement_stale") == 1  # once per change, not per probe
    metrics = await (await client.get("/metrics")).text()
    age = next(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("kubelora_router_placement_age_seconds "))
    assert age > 0.6
    client.path.write_text(placement_text(engines, revision=5))  # readable again: fresh and ready at once
    await _until(lambda: client.app[STATE].store.age_s() < 0.5)
    assert (await client.get("/ready")).status == 200
    assert "placement_fresh" in [r.getMessage() for r in caplog.records]
    assert (await (await client.get("/placement")).json())["revision"] == 5


async def test_a_steady_placement_stays_fresh(engines, file_router):
    client = await file_router(placement_text(engines, revision=1), poll_interval=0.1, max_placement_age=0.5)
    await asyncio.sleep(0.8)  # unchanged bytes still confirm the placement each poll
    assert (await client.get("/ready")).status == 200
    assert (await (await client.get("/placement")).json())["ageSeconds"] < 0.5


async def test_max_placement_age_zero_never_fails_ready(engines, file_router):
    client = await file_router(placement_text(engines, revision=1), poll_interval=0.1, max_placement_age=0)
    client.path.unlink()
    await asyncio.sleep(0.5)
    assert (await client.get("/ready")).status == 200


def test_max_placement_age_is_validated():
    with pytest.raises(ValueError, match="max_placement_age"):
        RouterConfig(placement_file="p", poll_interval=1.0, max_placement_age=0.5)


async def test_a_stale_view_is_retried_through_every_replica(engines, router):
    """The placement names two holders that are gone (pods deleted since it was read): the request goes on to
    the one live replica of the view, which loads the adapter on demand; the dead ones are then tried last."""
    dead = [{"pod": f"dead{i}", "url": f"http://127.0.0.1:{free_port()}", "ready": True} for i in range(2)]
    text = placement_text(engines[:1], adapters={"a": ["dead0", "dead1"]}, extra_replicas=dead)
    client = await router(text)
    response = await client.post("/v1/completions", json={"model": "a", "prompt": "hi", "max_tokens": 2})
    assert response.status == 200 and response.headers[REPLICA_HEADER] == "p0"
    metrics = await (await client.get("/metrics")).text()
    assert "kubelora_router_retries_total 2.0" in metrics
    for _ in range(3):  # the next requests skip the dead replicas: no more connect errors
        response = await client.post("/v1/completions", json={"model": "a", "prompt": "hi", "max_tokens": 2})
        assert response.status == 200 and response.headers[REPLICA_HEADER] == "p0"
    metrics = await (await client.get("/metrics")).text()
    assert "kubelora_router_retries_total 2.0" in metrics
    assert engines[0].seen == ["a"] * 4
