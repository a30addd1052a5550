"""The routing rule with affinity: tiers (device, host, home), the affinity key among a tier, the load bound above
both; and the key itself (what it covers, what it reads)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest

from kubelora.router import routing
from kubelora.router.affinity import CONVERSATION_HEADER, PREFIX_CHARS, affinity_key
from kubelora.router.app import MAX_BODY_BYTES
from kubelora.router.hashring import HashRing
from kubelora.router.placement import parse_placement
from kubelora.router.proxy import REPLICA_HEADER

from .conftest import placement_text

PODS = ("p0", "p1", "p2")


def placement(adapters=None, on_device=None):
    replicas = [{"pod": pod, "url": f"http://10.0.0.{i}:8000", "ready": True} for i, pod in enumerate(PODS)]
    raw = {"pool": "p", "baseModel": "base", "revision": 1, "replicas": replicas, "adapters": adapters or {}}
    if on_device is not None:
        raw["onDevice"] = on_device
    return parse_placement(json.dumps(raw))


def chat(system: str, first_user: str, num_turns: int = 1, **fields) -> dict:
    """A chat's request at turn `num_turns`: the system prompt, then the whole history."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": first_user}]
    for turn in range(1, num_turns):
        messages += [{"role": "assistant", "content": f"answer {turn}"}, {"role": "user", "content": f"more {turn}"}]
    return {"model": "a", "messages": messages, **fields}


def first_pod(p, model: str, payload: dict, in_flight=None, headers=None) -> str:
    key = affinity_key(model, payload, headers or {})
    return routing.route(p, model, in_flight or {}, 1.0, affinity=key).candidates[0].pod


def test_one_conversation_stays_on_one_replica_turn_after_turn():
    p = placement(adapters={"a": list(PODS)})
    for i in range(20):
        pods = {first_pod(p, "a", chat("You are a helpful bank clerk.", f"question {i}", turns)) for turns in
                range(1, 6)}
        assert len(pods) == 1, i


def test_different_system_prompts_spread_over_the_holders():
    p = placement(adapters={"a": list(PODS)})
    counts = Counter(first_pod(p, "a", chat(f"You are assistant number {i}.", "hello")) for i in range(300))
    assert set(counts) == set(PODS) and min(counts.values()) > 50  # about 100 each


def test_the_load_bound_overrides_affinity():
    p = placement(adapters={"a": list(PODS)})
    payload = chat("system", "hello")
    home = first_pod(p, "a", payload)
    # At its share of the in-flight requests the conversation's replica passes the request on.
    moved = first_pod(p, "a", payload, in_flight={home: 3, "p0" if home != "p0" else "p1": 1})
    assert moved != home
    assert first_pod(p, "a", payload, in_flight={home: 1, **{pod: 1 for pod in PODS}}) == home  # all equal: stays


def test_tier_order_device_then_host_then_home():
    p = placement(adapters={"a": ["p0", "p1", "p2"], "b": ["p1"], "c": []}, on_device={"a": ["p2"], "b": ["p0"]})
    for i in range(30):  # whatever the key, the device holder first while it is under the bound
        route = routing.route(p, "a", {}, 1.0, affinity=affinity_key("a", chat(f"s{i}", "u"), {}))
        assert route.decision is routing.Decision.DEVICE and [r.pod for r in route.candidates][0] == "p2"
    # Over its share of all holders' load, the device holder passes the request to a host holder.
    route = routing.route(p, "a", {"p2": 2}, 1.0, affinity=affinity_key("a", chat("s", "u"), {}))
    assert route.decision is routing.Decision.HOLDER and route.candidates[0].pod in ("p0", "p1")
    assert [r.pod for r in route.candidates][-1] == "p2"  # still a retry candidate
    # "b" on device at p0 is ignored: p0 does not hold it (not listed in adapters); p1 holds it in host memory.
    route = routing.route(p, "b", {}, 1.0, affinity="k")
    assert route.decision is routing.Decision.HOLDER and route.candidates[0].pod == "p1"
    # No holder: the home, keyed by the model whatever the affinity key (one replica loads it).
    homes = {routing.route(p, "c", {}, 1.0, affinity=f"k{i}").candidates[0].pod for i in range(20)}
    assert homes == {HashRing(list(PODS)).walk("c")[0]}


def test_base_model_requests_follow_their_affinity_key_under_the_bound():
    p = placement()
    payload = chat("system", "hello") | {"model": "base"}
    home = first_pod(p, "base", payload)
    assert all(first_pod(p, "base", chat("system", "hello", n) | {"model": "base"}) == home for n in range(1, 4))
    assert first_pod(p, "base", payload, in_flight={home: 1}) != home


def test_the_key_covers_model_and_cache_salt():
    payload = chat("same system prompt", "same question")
    keys = {affinity_key("a", payload, {}), affinity_key("b", payload, {}),
            affinity_key("a", payload | {"cache_salt": "s1"}, {}),
            affinity_key("a", payload | {"cache_salt": "s2"}, {})}
    assert len(keys) == 4
    # A salt equal to another model's name is still a salt: no key of one kind stands for another.
    assert affinity_key("a", payload | {"cache_salt": "b"}, {}) != affinity_key("b", payload, {})


def test_conversation_header_then_user_then_prefix():
    payload = chat("system", "hello")
    by_prefix = affinity_key("a", payload, {})
    by_user = affinity_key("a", payload | {"user": "alice"}, {})
    by_header = affinity_key("a", payload | {"user": "alice"}, {CONVERSATION_HEADER: "c-1"})
    assert len({by_prefix, by_user, by_header}) == 3
    assert by_user == affinity_key("a", chat("other system", "other") | {"user": "alice"}, {})
    assert by_header == affinity_key("a", chat("x", "y"), {CONVERSATION_HEADER: "c-1"})
    # Completions key on the prompt's start, as text or as token ids; nothing to key on gives None.
    assert affinity_key("a", {"prompt": "x" * 10}, {}) != affinity_key("a", {"prompt": [1, 2, 3]}, {})
    assert affinity_key("a", {"prompt": ["p", "q"]}, {}) == affinity_key("a", {"prompt": "p"}, {})
    assert affinity_key("a", {"prompt": ""}, {}) is None and affinity_key("a", {"messages": []}, {}) is None


def test_the_key_reads_only_the_start_of_the_first_messages():
    system = "s" * PREFIX_CHARS
    one, two = chat(system + "tail one", "u"), chat(system + "tail two", "u")
    assert affinity_key("a", one, {}) == affinity_key("a", two, {})
    # Nothing after the first user message is read: a later message of any shape changes nothing.
    payload = chat("system", "hello")
    odd = payload | {"messages": [*payload["messages"], "not a message", {"role": "user", "content": 7}]}
    assert affinity_key("a", odd, {}) == affinity_key("a", payload, {})
    parts = [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]
    assert affinity_key("a", chat("system", parts), {}) == affinity_key("a", payload, {})


def test_placement_on_device_is_validated():
    with pytest.raises(ValueError, match="onDevice"):
        placement(adapters={"a": ["p0"]}, on_device={"a": "p0"})
    assert placement(adapters={"a": ["p0"]}).holder_tiers("a") == ((), ("p0",))


async def test_a_conversation_header_keeps_turns_on_one_engine(engines, router):
    client = await router(placement_text(engines, adapters={"a": ["p0", "p1", "p2"]}))
    for conversation in ("c-1", "c-2", "c-3", "c-4"):
        answered = set()
        for turns in range(1, 4):
            response = await client.post("/v1/chat/completions", json=chat(f"sys {turns}", f"u {turns}", turns),
                                         headers={CONVERSATION_HEADER: conversation})
            assert response.status == 200
            answered.add(response.headers[REPLICA_HEADER])
        assert len(answered) == 1, conversation


async def test_a_body_over_the_limit_is_413_and_reaches_no_engine(engines, router):
    client = await router(placement_text(engines, adapters={"a": ["p0"]}))
    body = json.dumps(chat("x" * MAX_BODY_BYTES, "hello")).encode()
    response = await client.post("/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    assert response.status == 413
    await asyncio.sleep(0)
    assert not any(e.seen for e in engines)
