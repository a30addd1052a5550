"""Bulk deletes cost what they must: the deletion handler waits for the pool's reconcile instead of
unloading on its own, so each (pod, adapter) gets one unload, nothing is loaded, and deletes arriving together
share passes. The real handlers and daemon run against fake engines and an in-memory API."""
from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import kopf
import pytest

from kubelora.operator import handlers
from kubelora.operator import observe as observe_module
from kubelora.operator.runtime import Runtime
from kubelora.operator.settings import OperatorSettings

from .test_reconcile import NS, FakeEngine, FakeKube, pool_object, serve_engines
from .test_handlers import LOG

NUM_ADAPTERS, NUM_DELETED = 24, 16


class CountingKube(FakeKube):
    """Counts reconcile passes (each lists the pool's adapters once) and placement publications."""

    def __init__(self) -> None:
        super().__init__()
        self.num_passes = 0
        self.num_placements = 0

    async def list_custom(self, plural, namespace):
        self.num_passes += plural == "loraadapters"
        return await super().list_custom(plural, namespace)

    async def apply(self, manifest):
        self.num_placements += manifest["metadata"]["name"] == "p-placement"
        await super().apply(manifest)


class Flag:
    """kopf's DaemonStopped as the daemon reads it: falsy until set."""

    def __init__(self) -> None:
        self.is_set = False

    def __bool__(self) -> bool:
        return self.is_set


@pytest.fixture
async def cluster(aiohttp_server, monkeypatch):
    monkeypatch.setattr(observe_module, "pod_admin_url", lambda p: p["metadata"]["annotations"]["test-url"])
    kube = CountingKube()
    kube.objects[("lorapools", "p")] = pool_object(8, 16)
    engines = {name: FakeEngine() for name in ("e0", "e1", "e2")}
    await serve_engines(aiohttp_server, kube, engines)
    settings = OperatorSettings(resync_s=30.0, debounce_s=0.05, backoff_initial_s=0.01, backoff_max_s=0.01)
    async with running_daemon(kube, settings) as runtime:
        yield kube, engines, runtime


@contextlib.asynccontextmanager
async def running_daemon(kube, settings: OperatorSettings):
    """The pool's operator daemon over the fake Kubernetes, stopped on exit."""
    async with aiohttp.ClientSession() as session:
        runtime = Runtime(settings=settings, kube=kube, kube_session=session, engine_session=session)
        stopped = Flag()
        daemon = asyncio.create_task(handlers.daemon_pool(name="p", namespace=NS, memo=kopf.Memo(runtime=runtime),
                                                          stopped=stopped, logger=LOG))
        yield runtime
        stopped.is_set = True
        runtime.trigger(NS, "p")
        await asyncio.wait_for(daemon, timeout=5)


async def converged(kube: CountingKube, runtime: Runtime) -> None:
    for _ in range(50):
        if all(kube.status(f"a{i}").get("phase") == "Ready" for i in range(NUM_ADAPTERS)):
            return
        runtime.trigger(NS, "p")
        await asyncio.sleep(0.05)
    raise AssertionError("the pool did not converge")


async def test_a_bulk_delete_makes_one_unload_per_adapter_and_pod_and_no_loads(cluster):
    kube, engines, runtime = cluster
    for i in range(NUM_ADAPTERS):
        kube.add_adapter(f"a{i}", f"/adapters/a{i}", replicas=1)
    runtime.trigger(NS, "p")
    await converged(kube, runtime)
    placement = json.loads(kube.applied["p-placement"]["data"]["placement.json"])
    for engine in engines.values():
        engine.calls.clear()
    passes, placements = kube.num_passes, kube.num_placements

    # A collection delete: the API server marks them all, then kopf runs every deletion handler at once.
    deleted = [f"a{i}" for i in range(NUM_DELETED)]
    for name in deleted:
        kube.objects[("loraadapters", name)]["metadata"]["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    bodies = [await kube.get_custom("loraadapters", NS, name) for name in deleted]
    await asyncio.wait_for(asyncio.gather(*(handlers.on_adapter_delete(body=b, memo=kopf.Memo(runtime=runtime),
                                                                       logger=LOG) for b in bodies)), timeout=10)
    for name in deleted:  # the finalizers are gone: so are the objects
        del kube.objects[("loraadapters", name)]

    calls = [(pod_name, call) for pod_name, engine in engines.items() for call in engine.calls]
    # Every adapter is registered on every pod (placed or preload: false), so each is unloaded once from each.
    assert sorted(calls) == sorted((p, ("unload", name)) for p in engines for name in deleted)
    assert not any(kind == "load" for _, (kind, _) in calls)
    assert kube.num_passes - passes <= 2 and kube.num_placements - placements <= 2
    # The survivors stay where they were, and a later pass has nothing to do.
    runtime.trigger(NS, "p")
    await asyncio.sleep(0.3)
    after = json.loads(kube.applied["p-placement"]["data"]["placement.json"])
    assert {a: after["adapters"][a] for a in after["adapters"]} == {
        a: pods for a, pods in placement["adapters"].items() if a not in deleted}
    assert sum(len(e.calls) for e in engines.values()) == len(calls)


async def test_a_deletion_waits_only_for_the_reconcile_of_a_pool_it_runs(cluster, monkeypatch):
    kube, engines, runtime = cluster
    kube.add_adapter("x", "/adapters/x")
    body = await kube.get_custom("loraadapters", NS, "x")
    body["metadata"]["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    orphan = {**body, "spec": {**body["spec"], "pool": "gone"}}
    started = asyncio.get_running_loop().time()
    await asyncio.wait_for(handlers.on_adapter_delete(body=orphan, memo=kopf.Memo(runtime=runtime), logger=LOG), 5)
    assert asyncio.get_running_loop().time() - started < 1  # no daemon for that pool: nothing to wait for
    # A pool whose reconcile cannot finish: the wait is bounded.
    monkeypatch.setattr(handlers, "release_timeout_s", lambda settings: 0.2)
    assert not await runtime.wait_released(NS, "p", "never-deleted", 0.2)


async def test_deletes_arriving_one_by_one_share_passes(cluster):
    """Single deletes a few ms apart (a loop of `kubectl delete`, or a GitOps prune): the daemon keeps gathering
    triggers while they keep coming (up to a bound), so they share a few passes instead of one pass each."""
    kube, engines, runtime = cluster
    for i in range(NUM_ADAPTERS):
        kube.add_adapter(f"a{i}", f"/adapters/a{i}", replicas=1)
    runtime.trigger(NS, "p")
    await converged(kube, runtime)
    for engine in engines.values():
        engine.calls.clear()
    passes = kube.num_passes

    async def delete(name: str, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        kube.objects[("loraadapters", name)]["metadata"]["deletionTimestamp"] = "2026-12-01T00:00:00Z"
        body = await kube.get_custom("loraadapters", NS, name)
        await handlers.on_adapter_event(body=body, event={"type": "MODIFIED"}, memo=kopf.Memo(runtime=runtime))
        await handlers.on_adapter_delete(body=body, memo=kopf.Memo(runtime=runtime), logger=LOG)
        del kube.objects[("loraadapters", name)]

    deleted = [f"a{i}" for i in range(NUM_DELETED)]
    await asyncio.wait_for(asyncio.gather(*(delete(n, 0.03 * i) for i, n in enumerate(deleted))), timeout=10)
    unloads = sorted((pod_name, call) for pod_name, engine in engines.items() for call in engine.calls
                     if call[0] == "unload")
    assert unloads == sorted((p, ("unload", name)) for p in engines for name in deleted)  # one per adapter and pod
    assert kube.num_passes - passes <= 2, kube.num_passes - passes
