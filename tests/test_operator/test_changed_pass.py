"""A pass for changed adapters only (decide.Change): it reads no model list and lists no adapters, yet leaves the
pool as a whole pass would, so the whole pass after it calls no engine, publishes the same placement and writes the
same statuses. And when it is not taken: a whole pass due, too many changes, something else triggered."""
from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import aiohttp
import pytest

from kubelora.operator import handlers
from kubelora.operator import observe as observe_module
from kubelora.operator.decide import Change, PassPlan, classify_adapters, moved, plan_pass
from kubelora.operator.memory import Published, ReconcileMemory
from kubelora.operator.placement import Placement
from kubelora.operator.reconcile import MAX_CHANGED_ADAPTERS, PoolReconciler
from kubelora.operator.runtime import Runtime
from kubelora.operator.settings import OperatorSettings

from .conftest import POOL, adapter, card, view
from .test_reconcile import NS, FakeEngine, FakeKube, pool_object, serve_engines

NUM_ADAPTERS = 16
REPLICAS = (1, 2, "all", 1)  # adapter i asks REPLICAS[i % 4]


class ListCountingEngine(FakeEngine):
    def __init__(self) -> None:
        super().__init__()
        self.num_lists = 0

    async def models(self, request):
        self.num_lists += 1
        return await super().models(request)


class ListCountingKube(FakeKube):
    def __init__(self) -> None:
        super().__init__()
        self.num_adapter_lists = 0

    async def list_custom(self, plural, namespace):
        self.num_adapter_lists += plural == "loraadapters"
        return await super().list_custom(plural, namespace)


@pytest.fixture
async def pool(aiohttp_server, monkeypatch):
    """A converged pool of 4 engines, each with room for 12 placed adapters, and NUM_ADAPTERS adapters."""
    monkeypatch.setattr(observe_module, "pod_admin_url", lambda p: p["metadata"]["annotations"]["test-url"])
    engines = {f"e{i}": ListCountingEngine() for i in range(4)}
    kube = ListCountingKube()
    kube.objects[("lorapools", "p")] = pool_object(2, 12)
    await serve_engines(aiohttp_server, kube, engines)
    for i in range(NUM_ADAPTERS):
        kube.add_adapter(f"a{i:02d}", f"/adapters/a{i:02d}", replicas=REPLICAS[i % 4])
    async with aiohttp.ClientSession() as session:
        settings = OperatorSettings(backoff_initial_s=0.01, backoff_max_s=0.01)
        reconciler = PoolReconciler(kube, session, settings, NS, "p")
        for _ in range(2):
            await reconciler.reconcile()
        assert all(kube.status(f"a{i:02d}")["phase"] == "Ready" for i in range(NUM_ADAPTERS))
        yield kube, engines, reconciler


def snapshot(kube: FakeKube, engines: dict) -> tuple:
    """Engine calls so far, the published placement and every adapter's status."""
    placement = json.loads(kube.applied["p-placement"]["data"]["placement.json"])
    statuses = {name: obj.get("status") for (plural, name), obj in kube.objects.items() if plural == "loraadapters"}
    return sum(len(e.calls) for e in engines.values()), placement, json.dumps(statuses, sort_keys=True)


def create(kube: FakeKube) -> frozenset[str]:
    for name, replicas in (("new0", 1), ("new1", 2), ("new2", "all")):
        kube.add_adapter(name, f"/adapters/{name}", replicas=replicas)
    return frozenset({"new0", "new1", "new2"})


def update(kube: FakeKube) -> frozenset[str]:
    body = kube.objects[("loraadapters", "a01")]
    body["spec"]["source"]["path"] = "/adapters/a01-v2"
    body["spec"]["replicas"] = 3
    body["metadata"]["generation"] = 2
    return frozenset({"a01"})


def delete(kube: FakeKube) -> frozenset[str]:
    kube.objects[("loraadapters", "a02")]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return frozenset({"a02"})


def gone(kube: FakeKube) -> frozenset[str]:
    del kube.objects[("loraadapters", "a03")]  # deleted and its finalizer gone (its pool never saw it deleting)
    return frozenset({"a03"})


def refused(kube: FakeKube) -> frozenset[str]:
    kube.add_adapter("big", "/adapters/big", replicas=2)  # the fake engine refuses it for its rank
    return frozenset({"big"})


@pytest.mark.parametrize("change", [create, update, delete, gone, refused])
async def test_a_pass_for_changed_adapters_leaves_what_a_whole_pass_would(pool, change):
    kube, engines, reconciler = pool
    lists = sum(e.num_lists for e in engines.values()), kube.num_adapter_lists
    released = []
    reconciler._on_released = released.extend
    changed = change(kube)
    await reconciler.reconcile(changed)
    assert (sum(e.num_lists for e in engines.values()), kube.num_adapter_lists) == lists  # nothing read again
    after_changed, released_by_it = snapshot(kube, engines), list(released)
    await reconciler.reconcile()  # a whole pass: it reads everything and decides over the whole pool
    assert snapshot(kube, engines) == after_changed
    if change is create:
        assert all(kube.status(name)["phase"] == "Ready" for name in changed)
        assert after_changed[1]["adapters"]["new2"] == ["e0", "e1", "e2", "e3"]
    elif change is update:
        assert kube.status("a01")["phase"] == "Ready" and kube.status("a01")["readyReplicas"] == 3
        assert all(card["source"] == "/adapters/a01-v2" for e in engines.values()
                   if (card := e.adapters.get("a01")) is not None)
    elif change is delete:
        assert released_by_it == ["a02"] and not any("a02" in e.adapters for e in engines.values())
    elif change is gone:
        assert not any("a03" in e.adapters for e in engines.values()) and "a03" not in after_changed[1]["adapters"]
    else:
        assert kube.status("big")["phase"] == "Failed"


async def test_chained_passes_for_changed_adapters_match_a_fresh_operators_whole_pass(pool):
    kube, engines, reconciler = pool
    for change in (create, update, delete):
        await reconciler.reconcile(change(kube))
    await reconciler.reconcile(frozenset({"new0"}))  # the last pass called engines for it: nothing left to do
    after_changed = snapshot(kube, engines)
    fresh = PoolReconciler(kube, reconciler._session, reconciler._settings, NS, "p")  # an operator restart
    await fresh.reconcile()
    after_whole = snapshot(kube, engines)
    assert after_whole[0] == after_changed[0] and after_whole[2] == after_changed[2]
    # a restarted operator publishes once more (it knows the ConfigMap's revision, not its payload): the same one
    assert {**after_whole[1], "revision": 0} == {**after_changed[1], "revision": 0}


async def test_a_whole_pass_comes_when_due_or_when_many_changed(pool):
    kube, engines, reconciler = pool

    def num_lists() -> int:
        return sum(e.num_lists for e in engines.values())

    before = num_lists()
    many = frozenset(f"a{i:02d}" for i in range(NUM_ADAPTERS)) | {f"x{i}" for i in range(MAX_CHANGED_ADAPTERS)}
    await reconciler.reconcile(many)
    assert num_lists() == before + len(engines)
    reconciler._whole_at -= reconciler._settings.resync_s  # a resync since the last whole pass
    assert reconciler.whole_pass_due_s == 0
    await reconciler.reconcile(frozenset({"a00"}))
    assert num_lists() == before + 2 * len(engines) and reconciler.whole_pass_due_s > 0
    await reconciler.reconcile(frozenset({"a00"}))
    assert num_lists() == before + 2 * len(engines)


async def test_triggers_tell_changed_adapters_apart_from_anything_else():
    runtime = Runtime(settings=OperatorSettings(), kube=None, kube_session=None, engine_session=None)
    runtime.trigger_adapter(NS, "p", "a")  # no daemon yet: nothing to tell
    assert runtime.take_changes(NS, "p") is None
    wake = runtime.trigger_for(NS, "p")
    runtime.trigger_adapter(NS, "p", "a")
    runtime.trigger_adapter(NS, "p", "b")
    assert wake.is_set() and runtime.take_changes(NS, "p") == {"a", "b"}
    assert runtime.take_changes(NS, "p") is None  # nothing asked since: a resync's whole pass
    runtime.trigger_adapter(NS, "p", "a")
    runtime.trigger(NS, "p")  # a pod, the pool, an engine's adapter set: a whole pass
    runtime.trigger_adapter(NS, "p", "b")
    assert runtime.take_changes(NS, "p") is None


async def test_gathering_waits_for_quiet_after_the_last_trigger_not_for_whole_windows():
    wake = asyncio.Event()
    loop = asyncio.get_running_loop()
    started = loop.time()
    loop.call_later(0.03, wake.set)  # one object's create comes as a few events close together
    loop.call_later(0.06, wake.set)
    await handlers.gather_triggers(wake, 0.3, 2.0)
    assert 0.35 <= loop.time() - started < 0.55  # 0.3 s after the last; whole windows would make it 0.6 s
    started = loop.time()
    for i in range(30):  # a burst longer than max_gather_s
        loop.call_later(0.02 * i, wake.set)
    await handlers.gather_triggers(wake, 0.2, 0.3)
    assert loop.time() - started < 0.55  # the burst goes on for 0.6 s


def test_a_change_plans_the_calls_of_adapters_it_moves_as_a_whole_plan_does():
    """Pure: a new adapter on a pool whose placement is lopsided (every copy on e0 and e1, as a pod set left it).
    Placing the whole pool moves copies of adapters the change does not name onto e2 and e3; the plan for the
    change calls for those too, exactly as the whole plan does."""
    pods = ("e0", "e1", "e2", "e3")
    bodies = [adapter(f"a{i:02d}") for i in range(12)]
    previous = {f"a{i:02d}": ("e0" if i < 6 else "e1",) for i in range(12)}
    held = {pod: {name: card(name, f"/adapters/{name}", "host" if pod in holders else "known")
                  for name, holders in previous.items()} for pod in pods}
    memory = ReconcileMemory(previous=previous, published=Published(1, ""))
    before = view(*bodies, held=held)
    last_adapters, _ = classify_adapters(before, memory)
    last = PassPlan(last_adapters, Placement(dict(previous), dict.fromkeys(previous, 1)), (), frozenset(),
                    POOL.fingerprint)
    after = replace(before, bodies={**before.bodies, "new": adapter("new")})
    whole, _ = plan_pass(after, memory, 1000.0)
    changed, _ = plan_pass(after, memory, 1000.0, Change(last, frozenset({"new"})))
    assert changed.placement == whole.placement
    assert moved(previous, whole.placement.pods_by_adapter) - {"new"}  # the change moved others
    assert sorted(map(repr, changed.actions)) == sorted(map(repr, whole.actions))
    assert changed.scope is not None and whole.scope is None


async def test_the_metrics_count_whole_passes_and_keep_every_adapters_phase(pool):
    from kubelora.operator.metered import MeteredReconciler
    from kubelora.operator.metrics import OperatorMetrics

    kube, engines, plain = pool
    metrics = OperatorMetrics()
    reconciler = MeteredReconciler(kube, plain._session, plain._settings, NS, "p", metrics=metrics)

    def sample(name: str, **labels) -> float | None:
        return metrics.registry.get_sample_value(name, {"namespace": NS, "pool": "p", **labels})

    await reconciler.reconcile()
    await reconciler.reconcile(refused(kube))  # a pass for "big" alone computes its status only
    await reconciler.reconcile(delete(kube))
    assert sample("kubelora_operator_reconcile_passes_total") == 3
    assert sample("kubelora_operator_reconcile_whole_passes_total") == 1
    assert sample("kubelora_operator_adapters", phase="Ready") == NUM_ADAPTERS - 1
    assert sample("kubelora_operator_adapters", phase="Failed") == 1


async def test_after_a_failed_pass_the_next_is_whole(pool):
    kube, engines, reconciler = pool

    def num_lists() -> int:
        return sum(e.num_lists for e in engines.values())

    patch_status = kube.patch_status

    async def refuse(*_args, **_kwargs):
        raise aiohttp.ClientConnectionError("refused")

    kube.patch_status = refuse  # the pass loads the new adapters, then fails writing their statuses
    with pytest.raises(aiohttp.ClientError):
        await reconciler.reconcile(create(kube))
    kube.patch_status = patch_status
    before = num_lists()
    await reconciler.reconcile(frozenset({"new0"}))
    assert num_lists() == before + len(engines)  # it read every pod again
    assert all(kube.status(name)["phase"] == "Ready" for name in ("new0", "new1", "new2"))
