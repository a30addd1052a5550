"""Tenant API keys at the router: 401 without a valid key, 403 for another tenant's model whether or not it
exists, `/v1/models` per key, revocation by placement, per-key rates with Retry-After, refusals counted by model
and never by key, no key in any log line."""

from __future__ import annotations

import json
import logging
import secrets

import pytest

from kubelora.contract.keys import build_table, grant_from_secret
from kubelora.router.limits import KeyLimits
from kubelora.router.placement import parse_placement

from .conftest import placement_text

pytestmark = pytest.mark.timeout(60)

KEY_A, KEY_B, KEY_BASE = secrets.token_hex(32), secrets.token_urlsafe(32), secrets.token_hex(32)


def keyed_placement(engines, *, keys=None, revision=1, **secret_fields) -> str:
    """Tenant a calls a1 and a2, tenant b calls b1; KEY_BASE calls only the base model."""
    keys = keys if keys is not None else {KEY_A: "a1, a2", KEY_B: "b1", KEY_BASE: ""}
    grants = [grant_from_secret({"key": key, "adapters": adapters, "baseModel": str(key == KEY_BASE).lower(),
                                 **secret_fields.get(key, {})}) for key, adapters in keys.items()]
    raw = json.loads(placement_text(engines, adapters={"a1": ["p0"], "a2": [], "b1": ["p1"]}, revision=revision))
    raw["apiKeys"] = build_table(True, grants).to_json()
    return json.dumps(raw)


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def post(client, model: str, headers: dict | None = None, **body):
    return await client.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 4, **body},
                             headers=headers or {})


async def test_a_key_calls_its_own_adapters_and_is_passed_on(engines, router):
    client = await router(keyed_placement(engines))
    for model in ("a1", "a2"):
        response = await post(client, model, bearer(KEY_A))
        assert response.status == 200, await response.text()
    assert engines[0].headers[0]["Authorization"] == f"Bearer {KEY_A}"  # the engine checks it again
    response = await post(client, "base", bearer(KEY_BASE))
    assert response.status == 200


async def test_another_tenants_model_is_403_and_does_not_say_whether_it_exists(engines, router):
    client = await router(keyed_placement(engines))
    errors = []
    for model in ("b1", "no-such-adapter", "base"):
        response = await post(client, model, bearer(KEY_A))
        assert response.status == 403
        errors.append((await response.json())["error"])
    for error, model in zip(errors, ("b1", "no-such-adapter", "base")):
        assert error == {"message": f"this API key may not call model {model!r}", "type": "permission_error",
                         "param": "model", "code": "model_not_permitted"}
    assert not any(e.seen for e in engines)


@pytest.mark.parametrize("headers", [
    {}, {"Authorization": ""}, {"Authorization": "Bearer"}, {"Authorization": "Bearer "},
    {"Authorization": f"Basic {KEY_A}"}, {"Authorization": f"Bearer {KEY_A[:-1]}"},
    {"Authorization": "Bearer " + "k" * 600}, {"Authorization": "Bearer ключ-🔑"},
    {"Authorization": f"bearer  {KEY_A}x"},
], ids=["none", "empty", "scheme-only", "blank", "basic", "truncated", "huge", "unicode", "suffixed"])
async def test_a_missing_or_wrong_key_is_401_in_the_openai_shape(engines, router, headers, caplog):
    client = await router(keyed_placement(engines))
    caplog.set_level(logging.DEBUG)
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = await client.post(path, json={"model": "a1", "prompt": "hi"}, headers=headers)
        assert response.status == 401 and response.headers["WWW-Authenticate"] == "Bearer"
        error = (await response.json())["error"]
        assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
        assert KEY_A not in await response.text()
    response = await client.get("/v1/models", headers=headers)
    assert response.status == 401
    assert not any(e.seen for e in engines)
    assert KEY_A not in caplog.text


async def test_a_repeated_authorization_header_is_401(engines, router):
    client = await router(keyed_placement(engines))
    response = await client.post("/v1/completions", json={"model": "a1", "prompt": "hi"},
                                 headers=[("Authorization", f"Bearer {KEY_A}"), ("Authorization", "Bearer x")])
    assert response.status == 401 and "one 'Authorization' header" in (await response.json())["error"]["message"]


async def test_the_key_is_checked_before_the_body_is_read_as_json(engines, router):
    client = await router(keyed_placement(engines))
    response = await client.post("/v1/completions", data=b"{not json")
    assert response.status == 401
    response = await client.post("/v1/completions", data=b"{not json", headers=bearer(KEY_A))
    assert response.status == 400


async def test_models_lists_what_the_key_may_call(engines, router):
    client = await router(keyed_placement(engines))
    listed = {}
    for name, key in (("a", KEY_A), ("b", KEY_B), ("base", KEY_BASE)):
        response = await client.get("/v1/models", headers=bearer(key))
        assert response.status == 200
        listed[name] = [card["id"] for card in (await response.json())["data"]]
    assert listed == {"a": ["a1", "a2"], "b": ["b1"], "base": ["base"]}


async def test_an_open_pool_asks_for_no_key(engines, router):
    client = await router(placement_text(engines, adapters={"a1": ["p0"]}))
    assert (await post(client, "a1")).status == 200
    models = await (await client.get("/v1/models")).json()
    assert [card["id"] for card in models["data"]] == ["base", "a1"]


async def test_a_revoked_key_is_401_and_a_rotated_one_works_from_the_next_placement(engines, router):
    client = await router(keyed_placement(engines))
    assert (await post(client, "a1", bearer(KEY_A))).status == 200
    new_key = secrets.token_hex(32)
    client.state.store.set(parse_placement(keyed_placement(engines, keys={new_key: "a1, a2", KEY_B: "b1"},
                                                           revision=2)))
    assert (await post(client, "a1", bearer(KEY_A))).status == 401
    assert (await post(client, "a1", bearer(new_key))).status == 200
    assert (await post(client, "b1", bearer(KEY_B))).status == 200


async def test_a_key_table_that_does_not_parse_is_refused_naming_the_field(engines):
    raw = json.loads(keyed_placement(engines))
    raw["apiKeys"]["keys"][0]["digest"] = KEY_B  # a key where a digest belongs
    with pytest.raises(ValueError, match="digest"):
        parse_placement(json.dumps(raw))


async def test_rates_are_per_key_and_answer_429_with_retry_after(engines, router):
    now = [0.0]
    client = await router(keyed_placement(engines, **{KEY_A: {"requestsPerMinute": "2"},
                                                       KEY_B: {"tokensPerMinute": "120"}}))
    client.state.limits = KeyLimits(clock=lambda: now[0])
    assert [(await post(client, "a1", bearer(KEY_A))).status for _ in range(2)] == [200, 200]
    response = await post(client, "a1", bearer(KEY_A))
    assert response.status == 429 and response.headers["Retry-After"] == "30"
    error = (await response.json())["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    assert (await post(client, "b1", bearer(KEY_B))).status == 200  # another key, its own buckets
    now[0] = 30.0  # one request refilled
    assert (await post(client, "a1", bearer(KEY_A))).status == 200
    # Tokens: a request may take the bucket into debt once (max_tokens 200 > 120); the next waits it out.
    assert (await post(client, "b1", bearer(KEY_B), max_tokens=200)).status == 200
    response = await post(client, "b1", bearer(KEY_B), max_tokens=1)
    assert response.status == 429 and int(response.headers["Retry-After"]) > 1


async def test_refusals_are_counted_by_model_never_by_key(engines, router):
    client = await router(keyed_placement(engines))
    await post(client, "b1", bearer(KEY_A))
    await post(client, "made-up", bearer(KEY_A))
    await post(client, "a1", {"Authorization": "Bearer wrong"})
    text = await (await client.get("/metrics")).text()
    assert 'kubelora_router_key_refusals_total{model="b1",status="403"} 1.0' in text
    assert 'kubelora_router_key_refusals_total{model="other",status="403"} 1.0' in text
    assert 'kubelora_router_key_refusals_total{model="a1",status="401"} 1.0' in text
    assert KEY_A not in text and "made-up" not in text
    report = await (await client.get("/placement")).json()  # the operator's events read these totals
    assert report["keyRefusals"] == {"b1": {"403": 1}, "a1": {"401": 1}}


async def test_a_key_granted_a_deleted_adapter_gets_404_for_it(engines, router):
    client = await router(keyed_placement(engines, keys={KEY_A: "a1, gone"}))
    response = await post(client, "gone", bearer(KEY_A))
    assert response.status == 404 and (await response.json())["error"]["code"] == "model_not_found"
    models = await (await client.get("/v1/models", headers=bearer(KEY_A))).json()
    assert [card["id"] for card in models["data"]] == ["a1"]


def test_a_key_of_bytes_that_are_not_utf8_is_401_not_an_error():
    """aiohttp hands such header bytes over as surrogate escapes."""
    from kubelora.contract.errors import Unauthorized
    from kubelora.contract.keys import build_table

    table = build_table(True, [grant_from_secret({"key": KEY_A, "adapters": "a1"})])
    with pytest.raises(Unauthorized):
        table.authorize(["Bearer " + b"\xff\xfe-not-utf8".decode("utf-8", "surrogateescape")])
