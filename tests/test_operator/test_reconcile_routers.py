"""The pool reconcile with a real router app in front: the pass that loads an adapter publishes the
placement, the router reads it when asked (`GET /placement?min_revision=N&wait=S`), and the adapter is written
Ready in that same pass; a router that cannot read its placement keeps it Loading/WaitingForRouters and asks
for a pass in 1 s. The router's placement source reads the fake API server's ConfigMap, as the ConfigMap
source reads the real one."""
from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from kubelora.router.app import build_app
from kubelora.router.config import RouterConfig
from kubelora.router.sources import PlacementStore
from kubelora.operator import observe as observe_module
from kubelora.operator.reconcile import PoolReconciler
from kubelora.operator.routers import RECHECK_BEHIND_S
from kubelora.operator.settings import OperatorSettings

from .test_reconcile import NS, FakeEngine, FakeKube, pool_object, serve_engines

pytestmark = pytest.mark.timeout(60)


class RoutedKube(FakeKube):
    """The fake API server, with router pods listed for the router selector."""

    def __init__(self) -> None:
        super().__init__()
        self.router_pods: list[dict] = []

    async def list_pods(self, namespace, selector):
        if "component=router" in selector:
            return [dict(p) for p in self.router_pods]
        return await super().list_pods(namespace, selector)


class FakeKubeSource:
    """The router's placement from the fake API server's ConfigMap; `is_broken`: reads fail (a refused token)."""

    def __init__(self, kube: RoutedKube, poll_interval: float) -> None:
        self.kube, self.poll_interval, self.is_broken = kube, poll_interval, False
        self._last: str | None = None

    async def run(self, store: PlacementStore) -> None:
        while True:
            if self.is_broken:
                store.fail("configmap ns/p-placement", "HTTP 401 Unauthorized", is_logged=False)
            else:
                text = (self.kube.applied.get("p-placement") or {}).get("data", {}).get("placement.json")
                if text is not None and text != self._last:
                    self._last = text
                    store.update(text, "configmap ns/p-placement")
                elif text is not None:
                    store.confirm()
            await store.pause(self.poll_interval)


@pytest.fixture
async def routed(aiohttp_server, monkeypatch):
    """(kube, router source, reconciler) with two fake engines and one router pod (a real router app whose poll
    is 30 s away: only the operator's nudge makes it read in time)."""
    monkeypatch.setattr(observe_module, "pod_admin_url", lambda p: p["metadata"]["annotations"]["test-url"])
    kube = RoutedKube()
    kube.objects[("lorapools", "p")] = pool_object(2, 4, router={"enabled": True})
    await serve_engines(aiohttp_server, kube, {name: FakeEngine() for name in ("e0", "e1")})
    source = FakeKubeSource(kube, poll_interval=30.0)
    router = await aiohttp_server(build_app(RouterConfig(pool="p", placement_configmap="p-placement",
                                                         poll_interval=30.0), PlacementStore(), source))
    monkeypatch.setattr(observe_module, "router_url", lambda ip: str(router.make_url("")).rstrip("/"))
    kube.router_pods.append({"metadata": {"name": "r0"}, "status": {
        "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}})
    async with aiohttp.ClientSession() as session:
        settings = OperatorSettings(backoff_initial_s=0.01, backoff_max_s=0.01)
        yield kube, source, PoolReconciler(kube, session, settings, NS, "p")


async def test_the_loading_pass_writes_ready_once_the_router_took_the_placement(routed):
    kube, _, reconciler = routed
    kube.add_adapter("a", "/adapters/a")
    started = time.monotonic()
    await reconciler.reconcile()
    assert time.monotonic() - started < 2.0  # the router read at once, not at its 30 s poll
    assert kube.status("a")["phase"] == "Ready"
    pool = kube.objects[("lorapools", "p")]["status"]
    (router,) = pool["routers"]
    assert router["name"] == "r0" and router["revision"] == pool["placementRevision"] and not router["stale"]
    assert {c["type"]: c["status"] for c in pool["conditions"]}["Degraded"] == "False"
    assert reconciler.next_pass_s is None


async def test_a_router_that_cannot_read_holds_new_adapters_back(routed):
    kube, source, reconciler = routed
    kube.add_adapter("a", "/adapters/a")
    await reconciler.reconcile()
    source.is_broken = True
    await asyncio.sleep(0.1)  # the router's next read (nudged by the next pass) fails
    kube.add_adapter("b", "/adapters/b")
    await reconciler.reconcile()
    assert kube.status("a")["phase"] == "Ready"  # the router's revision lists it
    b = kube.status("b")
    ready = next(c for c in b["conditions"] if c["type"] == "Ready")
    assert b["phase"] == "Loading" and ready["reason"] == "WaitingForRouters" and "r0" in ready["message"]
    assert reconciler.next_pass_s == RECHECK_BEHIND_S
    (router,) = kube.objects[("lorapools", "p")]["status"]["routers"]
    assert "behindSince" in router
    source.is_broken = False  # readable again: the next pass (asked for in 1 s) sees it taken
    await reconciler.reconcile()
    assert kube.status("b")["phase"] == "Ready" and reconciler.next_pass_s is None


async def test_a_router_that_stops_answering_leaves_adapters_ready_and_new_ones_become_ready(
        routed, aiohttp_server, monkeypatch):
    kube, _, reconciler = routed
    other = await aiohttp_server(build_app(RouterConfig(pool="p", placement_configmap="p-placement",
                                                        poll_interval=30.0), PlacementStore(),
                                           FakeKubeSource(kube, poll_interval=30.0)))
    urls = {"127.0.0.1": observe_module.router_url("127.0.0.1"), "127.0.0.2": str(other.make_url("")).rstrip("/")}
    monkeypatch.setattr(observe_module, "router_url", lambda ip: urls[ip])
    kube.router_pods.append({"metadata": {"name": "r1"}, "status": {
        "podIP": "127.0.0.2", "conditions": [{"type": "Ready", "status": "True"}]}})
    kube.objects[("lorapools", "p")]["spec"]["engine"]["maxCpuLoras"] = 16
    names = [f"t{i:02d}" for i in range(12)]
    for name in names:
        kube.add_adapter(name, f"/adapters/{name}")
    await reconciler.reconcile()
    assert {kube.status(name)["phase"] for name in names} == {"Ready"}
    urls["127.0.0.2"] = "http://127.0.0.1:9"  # r1 stays Ready per Kubernetes but answers nothing
    await reconciler.reconcile()
    assert {kube.status(name)["phase"] for name in names} == {"Ready"}
    kube.add_adapter("new", "/adapters/new")
    await reconciler.reconcile()
    assert kube.status("new")["phase"] == "Ready"  # r0 took the revision listing it
    routers = {r["name"]: r for r in kube.objects[("lorapools", "p")]["status"]["routers"]}
    assert "behindSince" in routers["r1"] and "behindSince" not in routers["r0"]
    assert reconciler.next_pass_s == RECHECK_BEHIND_S  # Degraded follows once r1 has been silent for 10 s
