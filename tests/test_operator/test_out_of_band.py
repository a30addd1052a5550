"""Out-of-band changes are repaired within seconds, not at the next resync: the daemon watches each
ready pod's adapter set with the engine's long poll (watch.py) and reconciles when it moves."""
from __future__ import annotations

import asyncio
import hashlib
import json

import aiohttp
import pytest
from aiohttp import web

from kubelora.operator import observe as observe_module
from kubelora.operator.engine_client import EngineClient
from kubelora.operator.settings import OperatorSettings
from kubelora.operator.watch import watch_pod

from .test_bulk_delete import CountingKube, running_daemon
from .test_handlers import LOG
from .test_reconcile import NS, FakeEngine, pool_object, serve_engines


class WatchableEngine(FakeEngine):
    """The fake engine with the adapter-set tag and `?changed_since=` long poll of the real one."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = asyncio.Event()
        self.num_lists = 0

    def tag(self) -> str:
        shown = sorted((n, c["source"], c["residency"] != "known") for n, c in self.adapters.items())
        return hashlib.sha256(json.dumps(shown).encode()).hexdigest()[:16]

    async def models(self, request):
        self.num_lists += 1
        since = request.query.get("changed_since")
        if since is not None and since == self.tag():
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), timeout=float(request.query.get("wait_s", "30")))
            except asyncio.TimeoutError:
                pass
        response = await super().models(request)
        response.headers["ETag"] = f'"{self.tag()}"'
        return response

    async def load(self, request):
        response = await super().load(request)
        self.changed.set()
        return response

    async def unload(self, request):
        response = await super().unload(request)
        self.changed.set()
        return response

    def drop_behind_the_operators_back(self, name: str) -> None:
        del self.adapters[name]
        self.changed.set()


@pytest.fixture
async def watched(aiohttp_server, monkeypatch):
    monkeypatch.setattr(observe_module, "pod_admin_url", lambda p: p["metadata"]["annotations"]["test-url"])
    kube = CountingKube()
    kube.objects[("lorapools", "p")] = pool_object(4, 8)
    engines = {name: WatchableEngine() for name in ("e0", "e1")}
    await serve_engines(aiohttp_server, kube, engines)
    async with running_daemon(kube, OperatorSettings(resync_s=30.0, debounce_s=0.05)) as runtime:
        yield kube, engines, runtime


async def _until(check, timeout_s: float) -> float:
    loop = asyncio.get_running_loop()
    started = loop.time()
    while not check():
        assert loop.time() - started < timeout_s, "timed out"
        await asyncio.sleep(0.02)
    return loop.time() - started


async def test_an_adapter_unloaded_behind_the_operators_back_is_back_within_a_second(watched):
    kube, engines, runtime = watched
    kube.add_adapter("a", "/adapters/a", replicas="all")
    runtime.trigger(NS, "p")
    await _until(lambda: kube.status("a").get("phase") == "Ready", 5)
    await asyncio.sleep(0.3)  # the watchers have their baseline
    passes = kube.num_passes
    engines["e1"].drop_behind_the_operators_back("a")
    took = await _until(lambda: engines["e1"].adapters.get("a", {}).get("residency") == "host", 5)
    assert took < 1.5 and kube.num_passes - passes <= 3  # the resync is 30 s away


async def test_a_steady_pool_keeps_one_open_request_per_pod(watched):
    kube, engines, runtime = watched
    kube.add_adapter("a", "/adapters/a", replicas="all")
    runtime.trigger(NS, "p")
    await _until(lambda: kube.status("a").get("phase") == "Ready", 5)
    await asyncio.sleep(0.5)
    lists = {name: engine.num_lists for name, engine in engines.items()}
    await asyncio.sleep(1.0)
    assert {name: engine.num_lists for name, engine in engines.items()} == lists  # waiting, not polling


async def test_engines_that_cannot_be_watched_are_left_to_the_resync(aiohttp_server):
    calls = []

    async def untagged(request):  # an older engine: no ETag, changed_since ignored
        calls.append(request.query.get("changed_since"))
        return web.json_response({"data": []})

    app = web.Application()
    app.router.add_get("/v1/models", untagged)
    server = await aiohttp_server(app)
    async with aiohttp.ClientSession() as session:
        client = EngineClient(session, None, 5)
        await asyncio.wait_for(watch_pod(client, str(server.make_url("")).rstrip("/"), lambda: None), timeout=2)
    assert calls == [None]  # one plain list, then it stops


async def test_a_watch_reads_the_tag_and_leaves_the_model_list_unparsed(aiohttp_server):
    """The long poll's answer is the whole model list (about 1 MB at 2,000 adapters): only its ETag is read. An
    error answer is still read as the engine's error."""
    from kubelora.operator.engine_client import EngineError

    async def tagged(request):
        if request.query.get("changed_since") == "bad":
            return web.json_response({"error": {"code": "invalid_request", "message": "no"}}, status=400)
        return web.Response(body=b"{not json", headers={"ETag": '"v2"'}, content_type="application/json")

    app = web.Application()
    app.router.add_get("/v1/models", tagged)
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    async with aiohttp.ClientSession() as session:
        client = EngineClient(session, None, 5)
        assert await client.wait_for_change(url, "v1", 0.1) == "v2"
        with pytest.raises(EngineError) as raised:
            await client.wait_for_change(url, "bad", 0.1)
    assert raised.value.status == 400
