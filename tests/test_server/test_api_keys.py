"""Tenant API keys on the engine's serving port (the last line behind the router): 401 without a key of the pushed
table, 403 for a model the key may not call before it is looked up, `/v1/models` per key, 503 until a table is
pushed, revocation at once, a request already running when its key is revoked finishes, no key in any log."""

from __future__ import annotations

import asyncio
import logging
import secrets

import pytest

from kubelora.contract.keys import build_table, grant_from_secret

KEY_A, KEY_B = secrets.token_hex(32), secrets.token_urlsafe(32)


def table(keys: dict[str, str], base: frozenset[str] = frozenset()) -> dict:
    grants = [grant_from_secret({"key": k, "adapters": a, "baseModel": str(k in base).lower()}) for k, a in keys.items()]
    return {"apiKeys": build_table(True, grants).to_json()}


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
async def keyed(start_app, config_for, material):
    """A server requiring keys, a0 and a1 loaded; tenant A may call a0 and the base model, tenant B a1."""
    client = await start_app(config_for(require_api_keys=True, lora=(("a0", str(material.adapters["a0"])),
                                                                      ("a1", str(material.adapters["a1"])))))
    client.base = (await (await client.admin.get("/v1/models")).json())["data"][0]["id"]
    return client


async def complete(client, model: str, key: str | None, **body):
    return await client.post("/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 3, **body},
                             headers=bearer(key) if key else {})


async def test_no_table_yet_is_503_then_the_pushed_table_is_enforced(keyed, api_error):
    await api_error(await complete(keyed, "a0", KEY_A), 503, "service_unavailable", code="api_keys_not_loaded")
    assert (await keyed.get("/health")).status == 200 and (await keyed.get("/ready")).status == 200
    assert (await keyed.get("/metrics")).status == 200
    answer = await (await keyed.admin.put("/v1/api_keys", json=table({KEY_A: "a0", KEY_B: "a1"},
                                                                     base=frozenset({KEY_A})))).json()
    assert answer["required"] is True and len(answer["fingerprint"]) == 64
    base_card = (await (await keyed.admin.get("/v1/models")).json())["data"][0]
    assert base_card["api_keys"] == answer
    assert (await complete(keyed, "a0", KEY_A)).status == 200
    assert (await complete(keyed, keyed.base, KEY_A)).status == 200
    assert (await complete(keyed, "a1", KEY_B)).status == 200
    response = await keyed.post("/v1/chat/completions", headers=bearer(KEY_B),
                                json={"model": "a1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert response.status == 200


async def test_refusals_are_401_and_403_without_saying_what_exists(keyed, api_error, caplog):
    await keyed.admin.put("/v1/api_keys", json=table({KEY_A: "a0", KEY_B: "a1"}))
    caplog.set_level(logging.DEBUG)
    for headers in ({}, {"Authorization": "Bearer "}, {"Authorization": f"Basic {KEY_A}"},
                    {"Authorization": "Bearer " + "x" * 5000}, {"Authorization": "Bearer ключ"}):
        for path in ("/v1/completions", "/v1/models", "/tokenize"):
            response = await keyed.request("POST" if path != "/v1/models" else "GET", path, headers=headers,
                                           json={"model": "a0", "prompt": "hi"})
            await api_error(response, 401, "authentication_error", code="invalid_api_key")
    response = await keyed.post("/v1/completions", json={"model": "a0", "prompt": "hi"},
                                headers=[("Authorization", f"Bearer {KEY_A}")] * 2)
    await api_error(response, 401, "authentication_error", code="invalid_api_key")
    messages = []
    for model in ("a1", "never-loaded", keyed.base):
        error = await api_error(await complete(keyed, model, KEY_A), 403, "permission_error", "model",
                                "model_not_permitted")
        messages.append(error["message"].replace(repr(model), "M"))
    assert len(set(messages)) == 1
    await api_error(await keyed.get("/v1/models/a1", headers=bearer(KEY_A)), 403, "permission_error", "model",
                    "model_not_permitted")
    await api_error(await keyed.post("/detokenize", json={"model": "a1", "tokens": [1]}, headers=bearer(KEY_A)),
                    403, "permission_error", "model", "model_not_permitted")
    assert KEY_A not in caplog.text and KEY_B not in caplog.text


async def test_models_lists_what_the_key_may_call(keyed):
    await keyed.admin.put("/v1/api_keys", json=table({KEY_A: "a0", KEY_B: "a1, a2-not-loaded"},
                                                     base=frozenset({KEY_A})))
    seen = {}
    for key in (KEY_A, KEY_B):
        seen[key] = [c["id"] for c in (await (await keyed.get("/v1/models", headers=bearer(key))).json())["data"]]
    assert seen == {KEY_A: [keyed.base, "a0"], KEY_B: ["a1"]}
    admin = [c["id"] for c in (await (await keyed.admin.get("/v1/models")).json())["data"]]
    assert admin == [keyed.base, "a0", "a1"]  # the operator's list is whole


async def test_a_revoked_key_is_refused_at_once_and_a_running_stream_finishes(keyed):
    await keyed.admin.put("/v1/api_keys", json=table({KEY_A: "a0", KEY_B: "a1"}))
    stream = await complete(keyed, "a0", KEY_A, stream=True, max_tokens=24, ignore_eos=True)
    assert stream.status == 200
    first = await stream.content.readline()
    assert first.startswith(b"data: ")
    await keyed.admin.put("/v1/api_keys", json=table({KEY_B: "a1"}))
    assert (await complete(keyed, "a0", KEY_A)).status == 401
    rest = await asyncio.wait_for(stream.read(), 30)
    assert rest.rstrip().endswith(b"data: [DONE]") and b'"error"' not in rest
    assert (await complete(keyed, "a1", KEY_B)).status == 200


@pytest.mark.parametrize("body, field", [
    ({}, "apiKeys"), ({"apiKeys": {"required": "yes"}}, "apiKeys"),
    ({"apiKeys": {"required": True, "keys": [{"digest": KEY_B}]}}, "apiKeys"),
    ({"apiKeys": {"required": False, "keys": []}}, "apiKeys.required"),
])
async def test_a_malformed_table_is_400_and_keeps_the_one_held(keyed, api_error, body, field):
    await keyed.admin.put("/v1/api_keys", json=table({KEY_A: "a0"}))
    await api_error(await keyed.admin.put("/v1/api_keys", json=body), 400, "invalid_request_error", field)
    assert (await complete(keyed, "a0", KEY_A)).status == 200


async def test_an_open_engine_asks_for_no_key(start_app, config_for, material):
    client = await start_app(config_for(lora=(("a0", str(material.adapters["a0"])),)))
    assert (await complete(client, "a0", None)).status == 200
    assert (await complete(client, "a0", "anything")).status == 200
