"""`GET /v1/models` tags the adapter set (`ETag`) and, on the admin port, waits for a change with
`?changed_since=`: the operator learns of an adapter unloaded or loaded behind its back within a
second, without polling."""

from __future__ import annotations

import asyncio
import time

from kubelora.engine.server import models_watch

TOKEN = "watch-token"


async def _tag(api) -> str:
    response = await api.get("/v1/models")
    assert response.status == 200
    return response.headers["ETag"].strip('"')


async def test_the_tag_follows_loads_and_unloads_not_traffic(start_app, config_for, material):
    api = await start_app(config_for())
    empty = await _tag(api)
    assert await _tag(api) == empty
    load = {"lora_name": "a0", "lora_path": str(material.adapters["a0"])}
    assert (await api.admin.post("/v1/load_lora_adapter", json=load)).status == 200
    loaded = await _tag(api)
    assert loaded != empty
    completion = await api.post("/v1/completions", json={"model": "a0", "prompt": "Hi", "max_tokens": 2})
    assert completion.status == 200 and await _tag(api) == loaded  # host <-> device moves do not change it
    assert (await api.admin.post("/v1/unload_lora_adapter", json={"lora_name": "a0"})).status == 200
    assert await _tag(api) == empty


async def test_a_wait_returns_on_a_change_or_after_wait_s(start_app, config_for, material, monkeypatch):
    monkeypatch.setattr(models_watch, "POLL_S", 0.05)
    api = await start_app(config_for(admin_token=TOKEN))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    tag = await _tag(api)
    started = time.monotonic()
    quiet = await api.admin.get("/v1/models", params={"changed_since": tag, "wait_s": "0.3"}, headers=auth)
    assert quiet.status == 200 and quiet.headers["ETag"].strip('"') == tag
    assert 0.3 <= time.monotonic() - started < 2

    async def load_later() -> None:
        await asyncio.sleep(0.2)
        response = await api.admin.post("/v1/load_lora_adapter", headers=auth,
                                   json={"lora_name": "a1", "lora_path": str(material.adapters["a1"]),
                                         "preload": False})
        assert response.status == 200

    started = time.monotonic()
    waiting = api.admin.get("/v1/models", params={"changed_since": tag, "wait_s": "30"}, headers=auth)
    changed, _ = await asyncio.gather(waiting, load_later())
    assert time.monotonic() - started < 5
    assert changed.headers["ETag"].strip('"') != tag
    assert "a1" in [card["id"] for card in (await changed.json())["data"]]
    stale = await api.admin.get("/v1/models", params={"changed_since": "not-the-tag"}, headers=auth)
    assert stale.status == 200  # a different tag answers at once


async def test_waits_are_bounded_and_need_the_admin_token(start_app, config_for, api_error, monkeypatch):
    monkeypatch.setattr(models_watch, "MAX_WATCHES", 2)
    api = await start_app(config_for(admin_token=TOKEN))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    tag = await _tag(api)
    await api_error(await api.admin.get("/v1/models", params={"changed_since": tag}), 401, "authentication_error")
    for bad in ("0", "-1", "61", "nan", "inf", "soon"):
        await api_error(await api.admin.get("/v1/models", params={"changed_since": tag, "wait_s": bad}, headers=auth),
                        400, "invalid_request_error", "wait_s", "out_of_range")
    held = [asyncio.ensure_future(api.admin.get("/v1/models", params={"changed_since": tag, "wait_s": "2"},
                                          headers=auth)) for _ in range(2)]
    await asyncio.sleep(0.3)
    await api_error(await api.admin.get("/v1/models", params={"changed_since": tag, "wait_s": "2"}, headers=auth), 429,
                    "rate_limit_error", "changed_since", "too_many_watches")
    assert (await api.get("/v1/models")).status == 200  # the plain list is not held up
    assert (await api.admin.get("/v1/models", headers=auth)).status == 200
    assert all(r.status == 200 for r in await asyncio.gather(*held))


async def test_the_serving_port_does_not_wait(start_app, config_for, api_error):
    api = await start_app(config_for(admin_token=TOKEN))
    tag = await _tag(api)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    await api_error(await api.get("/v1/models", params={"changed_since": tag}, headers=auth), 400,
                    "invalid_request_error", "changed_since", "invalid_value")
    assert (await api.admin.get("/v1/models", headers=auth)).headers["ETag"].strip('"') == tag  # one tag, both ports
