"""The operator's side of tenant API keys: key Secrets -> the digest table, pushed to the engines that hold
another, published with the placement; refused Secrets get a Warning event naming the reason, never the key;
the daemon's poll starts a pass when a key Secret changes."""

from __future__ import annotations

import asyncio
import base64
import json
import secrets

import aiohttp
import pytest
from aiohttp import web

from kubelora.contract.keys import KEY_SECRET_LABEL, key_digest
from kubelora.operator import observe as observe_module
from kubelora.operator.api_keys import engines_to_push, read_pool_keys, watch_key_secrets
from kubelora.operator.builders import build_engine_args
from kubelora.operator.reconcile import PoolReconciler
from kubelora.operator.settings import OperatorSettings
from kubelora.operator.specs import PoolSpec

from .test_reconcile import NS, FakeEngine, FakeKube, pool_object, serve_engines

KEY_A, KEY_B = secrets.token_hex(32), secrets.token_urlsafe(32)


def key_secret(name: str, version: str = "1", **data: str) -> dict:
    return {"metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "resourceVersion": version,
                         "labels": {KEY_SECRET_LABEL: "p"}},
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}}


def test_secrets_make_a_table_of_digests_and_refuse_weak_or_unreadable_ones():
    keys = read_pool_keys(True, [key_secret("a", key=KEY_A, adapters="a1,a2"), key_secret("b", key=KEY_B,
                                 adapters="b1", baseModel="true", requestsPerMinute="60"),
                                 key_secret("short", key="0123456789abcdef" * 3, adapters="a1"),
                                 key_secret("none", adapters="a1"), key_secret("bad-rate", key=secrets.token_hex(32),
                                                                               requestsPerMinute="-1")])
    assert set(keys.table.grants) == {key_digest(KEY_A), key_digest(KEY_B)}
    grant = keys.table.grants[key_digest(KEY_B)]
    assert grant.adapters == {"b1"} and grant.base_model and grant.requests_per_minute == 60
    assert [(r.name, r.reason) for r in keys.refused] == [("bad-rate", "InvalidRateLimit"), ("none", "MissingKey"),
                                                          ("short", "WeakKey")]
    text = json.dumps(keys.table.to_json()) + json.dumps(keys.status())
    assert KEY_A not in text and KEY_B not in text
    assert keys.status()["numKeys"] == 2
    assert not read_pool_keys(False, [key_secret("a", key=KEY_A)]).table.required


def test_only_engines_holding_another_table_get_it():
    table = read_pool_keys(True, [key_secret("a", key=KEY_A, adapters="a1")]).table
    assert engines_to_push(table, {"e0": table.fingerprint(), "e1": None, "e2": "old"}) == ["e1", "e2"]


class KeyedEngine(FakeEngine):
    def __init__(self) -> None:
        super().__init__()
        self.table: dict | None = None
        self.puts = 0

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_put("/v1/api_keys", self.put_keys)
        return app

    async def models(self, request):
        from kubelora.contract.keys import parse_table
        fingerprint = parse_table(self.table).fingerprint() if self.table is not None else None
        base = {"id": "base", "parent": None, "api_keys": {"required": True, "fingerprint": fingerprint}}
        return web.json_response({"data": [base] + list(self.adapters.values())})

    async def put_keys(self, request):
        self.puts += 1
        self.table = (await request.json())["apiKeys"]
        return web.json_response({})


class KeyedKube(FakeKube):
    def __init__(self) -> None:
        super().__init__()
        self.key_secrets: dict[str, dict] = {}
        self.num_lists = 0

    async def request(self, method, path, body=None, *, params=None, content_type=None):
        assert method == "GET" and path == f"/api/v1/namespaces/{NS}/secrets"
        assert params == {"labelSelector": f"{KEY_SECRET_LABEL}=p"}
        self.num_lists += 1
        return {"items": list(self.key_secrets.values())}


@pytest.fixture
async def keyed_world(aiohttp_server, monkeypatch):
    monkeypatch.setattr(observe_module, "pod_admin_url", lambda p: p["metadata"]["annotations"]["test-url"])
    engines = {name: KeyedEngine() for name in ("e0", "e1")}
    kube = KeyedKube()
    kube.objects[("lorapools", "p")] = pool_object(2, 4, apiKeys={"required": True})
    await serve_engines(aiohttp_server, kube, engines)
    async with aiohttp.ClientSession() as session:
        yield kube, engines, PoolReconciler(kube, session, OperatorSettings(), NS, "p")


def placement(kube) -> dict:
    return json.loads(kube.applied["p-placement"]["data"]["placement.json"])


async def test_the_table_reaches_engines_and_routers_and_a_revoked_key_leaves_both(keyed_world):
    kube, engines, reconciler = keyed_world
    kube.add_adapter("a1", "/adapters/a1")
    kube.key_secrets["a"] = key_secret("a", key=KEY_A, adapters="a1")
    kube.key_secrets["b"] = key_secret("b", key=KEY_B, adapters="b1")
    kube.key_secrets["weak"] = key_secret("weak", key="abc", adapters="a1")
    await reconciler.reconcile()
    published = placement(kube)
    assert {k["digest"] for k in published["apiKeys"]["keys"]} == {key_digest(KEY_A), key_digest(KEY_B)}
    assert all(e.table == published["apiKeys"] for e in engines.values())
    pool = PoolSpec.from_body(kube.objects[("lorapools", "p")])
    assert pool.require_api_keys and build_engine_args(pool)[-1] == "--require-api-keys"
    status = kube.objects[("lorapools", "p")]["status"]["apiKeys"]
    assert status["numKeys"] == 2 and [s["reason"] for s in status["refusedSecrets"]] == ["WeakKey"]
    assert ("weak", "Warning", "WeakKey") in kube.events
    assert not any(KEY_A in json.dumps(o) or KEY_B in json.dumps(o) for o in kube.applied.values())

    await reconciler.reconcile()  # converged: no push, no new revision, no second event
    assert [e.puts for e in engines.values()] == [1, 1] and placement(kube)["revision"] == published["revision"]
    assert kube.events.count(("weak", "Warning", "WeakKey")) == 1
    assert reconciler.key_versions == {("a", "1"), ("b", "1"), ("weak", "1")}

    del kube.key_secrets["a"]  # revoked
    await reconciler.reconcile()
    revoked = placement(kube)
    assert revoked["revision"] > published["revision"]
    assert [k["digest"] for k in revoked["apiKeys"]["keys"]] == [key_digest(KEY_B)]
    assert all(e.table == revoked["apiKeys"] for e in engines.values())


async def test_a_pool_without_keys_lists_no_secrets_and_pushes_nothing(keyed_world):
    kube, engines, reconciler = keyed_world
    kube.objects[("lorapools", "p")]["spec"].pop("apiKeys")
    await reconciler.reconcile()
    assert kube.num_lists == 0 and "apiKeys" not in placement(kube) and reconciler.key_versions is None
    assert all(e.puts == 0 for e in engines.values())


async def test_the_poll_starts_a_pass_when_a_key_secret_changes():
    kube = KeyedKube()
    kube.key_secrets["a"] = key_secret("a", key=KEY_A)
    known = {("a", "1")}
    changed = asyncio.Event()
    task = asyncio.create_task(watch_key_secrets(kube, NS, "p", lambda: frozenset(known), changed.set, poll_s=0.01))
    try:
        await asyncio.sleep(0.1)
        assert not changed.is_set() and kube.num_lists >= 2
        kube.key_secrets["a"] = key_secret("a", version="2", key=KEY_B)
        await asyncio.wait_for(changed.wait(), 5)
    finally:
        task.cancel()


def test_refusals_become_one_event_per_adapter_a_minute_counted_across_routers():
    from kubelora.operator.api_keys import REFUSAL_EVENT_EVERY_S, RefusalMemory, refusal_events

    adapters = ["a1", "b1"]
    totals = {"r0": {"a1": {"403": 3}, "other-tenant-thing": {"403": 9}}, "r1": {"a1": {"429": 2}}}
    messages, memory = refusal_events(RefusalMemory(), totals, adapters, now=0.0)
    assert list(messages) == ["a1"] and messages["a1"].startswith("5 requests for it were refused")
    assert "3 x 403" in messages["a1"] and "2 x 429" in messages["a1"]
    totals["r0"]["a1"]["403"] = 4  # one more, within the minute: held back, then told with what follows
    messages, memory = refusal_events(memory, totals, adapters, now=10.0)
    assert messages == {}
    totals["r1"] = {"a1": {"429": 1}}  # r1 restarted: its new total is all new
    messages, memory = refusal_events(memory, totals, adapters, now=REFUSAL_EVENT_EVERY_S + 1)
    assert messages["a1"].startswith("2 requests") and "1 x 403" in messages["a1"] and "1 x 429" in messages["a1"]
    messages, memory = refusal_events(memory, totals, adapters, now=2 * REFUSAL_EVENT_EVERY_S + 2)
    assert messages == {}  # nothing new


async def test_a_pass_posts_the_routers_refusals_on_the_adapter(keyed_world):
    from kubelora.operator.observe import RouterAck
    from kubelora.operator.routers import RouterView

    kube, _, reconciler = keyed_world
    kube.add_adapter("a1", "/adapters/a1")
    await reconciler.reconcile()
    ack = RouterAck("r0", "10.0.0.9", True, revision=1, key_refusals={"a1": {"403": 2}})
    view = type("View", (), {"bodies": {"a1": kube.objects[("loraadapters", "a1")]}})()
    await reconciler._tell_refusals(view, RouterView({"r0": ack}, 0.0))
    assert ("a1", "Warning", "RequestsRefused") in kube.events
