"""The kopf handlers' own logic with a fake runtime (no cluster): deletion never hangs, bad pools are permanent."""
from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import kopf
import pytest

from kubelora.operator import handlers
from kubelora.operator.kube import KubeError
from kubelora.operator.runtime import Runtime
from kubelora.operator.settings import OperatorSettings
from kubelora.operator.specs import PoolSpec
from kubelora.operator.writes import AdminToken, read_admin_token

LOG = logging.getLogger("test")


class FakeKube:
    def __init__(self, pods=(), fail_apply=False):
        self.pods, self.fail_apply = list(pods), fail_apply
        self.applied, self.deleted, self.statuses, self.created, self.events = [], [], [], [], []
        self.existing: set[tuple[str, str]] = set()

    async def create(self, manifest):
        key = (manifest["kind"], manifest["metadata"]["name"])
        self.created.append((*key, manifest))
        if key in self.existing:
            return False
        self.existing.add(key)
        return True

    async def list_pods(self, namespace, selector):
        return self.pods

    async def read_secret_key(self, namespace, name, key):
        return (await self.read_secret_data(namespace, name) or {}).get(key)

    async def read_secret_data(self, namespace, name):
        return next((dict(m["stringData"]) for kind, n, m in self.created if kind == "Secret" and n == name), None)

    async def get_custom(self, plural, namespace, name):
        return None

    async def apply(self, manifest):
        if self.fail_apply:
            raise KubeError(500, "etcd is sad")
        self.applied.append((manifest["kind"], manifest["metadata"]["name"]))

    async def delete(self, kind, namespace, name):
        self.deleted.append((kind, name))
        return False

    async def patch_status(self, plural, namespace, name, status):
        self.statuses.append((plural, name, status))

    async def create_event(self, involved, event_type, reason, message):
        self.events.append((involved["metadata"]["name"], event_type, reason, message))


@pytest.fixture
async def runtime_for():
    sessions = []

    def make(kube):
        session = aiohttp.ClientSession()
        sessions.append(session)
        return Runtime(settings=OperatorSettings(), kube=kube, kube_session=session, engine_session=session)

    yield make
    for session in sessions:
        await session.close()


def pool_body(**spec):
    return {"apiVersion": "kubelora.io/v1alpha1", "kind": "LoRAPool",
            "metadata": {"name": "p", "namespace": "ns", "uid": "u", "generation": 4},
            "spec": {"model": {"path": "/m/x"}, **spec}}


async def test_pool_objects_applied_router_removed_and_daemon_triggered(runtime_for):
    kube = FakeKube()
    runtime = runtime_for(kube)
    wake = runtime.trigger_for("ns", "p")
    await handlers.on_pool_spec(body=pool_body(), memo=kopf.Memo(runtime=runtime), logger=LOG)
    assert kube.applied == [("Deployment", "p-engine"), ("Service", "p-engine"), ("Service", "p"),
                            ("NetworkPolicy", "p-engine")]
    assert ("Deployment", "p-router") in kube.deleted and wake.is_set()


async def test_the_admin_token_secret_is_created_once_with_a_random_token(runtime_for):
    kube = FakeKube()
    runtime = runtime_for(kube)
    for _ in range(2):  # create, then an update: the update finds the Secret and leaves it alone
        await handlers.on_pool_spec(body=pool_body(), memo=kopf.Memo(runtime=runtime), logger=LOG)
    (kind, name, first), = kube.created
    assert (kind, name) == ("Secret", "p-engine-admin") and first["metadata"]["ownerReferences"][0]["uid"] == "u"
    assert len(first["stringData"]["token"]) >= 32 and ("Secret", "p-engine-admin") not in kube.applied
    kube.created.clear()
    await handlers.on_pool_spec(body=pool_body(adminTokenSecretRef={"name": "mine"}), memo=kopf.Memo(runtime=runtime),
                                logger=LOG)
    assert kube.created == []  # the pool names its own Secret: nothing created
    kube.existing.add(("Secret", "p-engine-admin"))  # created by someone else between our read and our create
    kube.read_secret_data = lambda *_, calls=iter([None, {"token": "theirs"}]): asyncio.sleep(0, next(calls))
    token = await read_admin_token(kube, pool_body(), PoolSpec.from_body(pool_body()))
    assert token == AdminToken("theirs", is_new=True) and len(kube.created) == 1  # theirs is kept, and rolled onto


async def test_a_disabled_network_policy_is_deleted(runtime_for):
    from kubelora.operator.settings import NetworkPolicySettings

    kube = FakeKube()
    runtime = runtime_for(kube)
    runtime.settings = OperatorSettings(network_policy=NetworkPolicySettings(is_enabled=False))
    await handlers.on_pool_spec(body=pool_body(), memo=kopf.Memo(runtime=runtime), logger=LOG)
    assert ("NetworkPolicy", "p-engine") in kube.deleted
    assert "NetworkPolicy" not in [kind for kind, _ in kube.applied]


async def test_invalid_pool_is_permanent_and_transient_failures_retry(runtime_for):
    kube = FakeKube()
    with pytest.raises(kopf.PermanentError):
        await handlers.on_pool_spec(body=pool_body(engine={"maxLoras": 8, "maxCpuLoras": 2}),
                                    memo=kopf.Memo(runtime=runtime_for(kube)), logger=LOG)
    (_, _, status), = kube.statuses
    assert status["conditions"][0]["reason"] == "InvalidSpec" and status["observedGeneration"] == 4
    assert {c["type"]: c["status"] for c in status["conditions"]} == {"Ready": "False", "Reconciling": "False",
                                                                      "Stalled": "True", "Degraded": "False"}
    with pytest.raises(kopf.TemporaryError):
        await handlers.on_pool_spec(body=pool_body(), memo=kopf.Memo(runtime=runtime_for(FakeKube(fail_apply=True))),
                                    logger=LOG)


async def test_adapter_delete_never_hangs_on_unreachable_pods(runtime_for, monkeypatch):
    monkeypatch.setattr(handlers, "UNLOAD_ON_DELETE_TIMEOUT_S", 0.5)
    unreachable = {"metadata": {"name": "e0"}, "status": {"podIP": "192.0.2.1", "conditions": [
        {"type": "Ready", "status": "True"}]}}
    body = {"metadata": {"name": "a", "namespace": "ns"}, "spec": {"pool": "p"}}
    started = time.monotonic()
    await asyncio.wait_for(handlers.on_adapter_delete(body=body, memo=kopf.Memo(runtime=runtime_for(
        FakeKube([unreachable]))), logger=LOG), timeout=10)
    assert time.monotonic() - started < 5


async def test_adapter_events_trigger_only_on_spec_changes(runtime_for):
    runtime = runtime_for(FakeKube())
    wake = runtime.trigger_for("ns", "p")
    settled = {"metadata": {"name": "a", "namespace": "ns", "generation": 2}, "spec": {"pool": "p"},
               "status": {"observedGeneration": 2}}
    await handlers.on_adapter_event(body=settled, event={"type": "MODIFIED"}, memo=kopf.Memo(runtime=runtime))
    assert not wake.is_set()
    changed = {**settled, "metadata": {**settled["metadata"], "generation": 3}}
    await handlers.on_adapter_event(body=changed, event={"type": "MODIFIED"}, memo=kopf.Memo(runtime=runtime))
    assert wake.is_set()


async def test_a_new_retry_request_triggers_until_the_status_answers_it(runtime_for):
    runtime = runtime_for(FakeKube())
    wake = runtime.trigger_for("ns", "p")
    asked = {"metadata": {"name": "a", "namespace": "ns", "generation": 2,
                          "annotations": {"kubelora.io/retry": "2026-12-01T23:00"}},
             "spec": {"pool": "p"}, "status": {"observedGeneration": 2}}
    await handlers.on_adapter_event(body=asked, event={"type": "MODIFIED"}, memo=kopf.Memo(runtime=runtime))
    assert wake.is_set()
    wake.clear()
    answered = {**asked, "status": {"observedGeneration": 2, "retryRequest": "2026-12-01T23:00"}}
    await handlers.on_adapter_event(body=answered, event={"type": "MODIFIED"}, memo=kopf.Memo(runtime=runtime))
    assert not wake.is_set()


async def test_adapter_of_a_missing_pool_is_pending(runtime_for):
    kube = FakeKube()
    body = {"metadata": {"name": "a", "namespace": "ns", "generation": 1}, "spec": {"pool": "nope"}}
    await handlers.on_adapter_event(body=body, event={"type": "ADDED"}, memo=kopf.Memo(runtime=runtime_for(kube)))
    (plural, name, status), = kube.statuses
    assert (plural, name, status["phase"]) == ("loraadapters", "a", "Pending")
    assert status["conditions"][-1]["reason"] == "PoolNotFound"
    (event,) = kube.events
    assert event[:3] == ("a", "Warning", "Pending") and "PoolNotFound" in event[3] and "'nope'" in event[3]
    written = {**body, "status": status}  # listed again (an operator restart): no second warning
    await handlers.on_adapter_event(body=written, event={"type": "ADDED"}, memo=kopf.Memo(runtime=runtime_for(kube)))
    assert len(kube.events) == 1


def test_pending_for_a_missing_pool_is_a_warning_also_after_another_pending():
    from kubelora.operator.report import phase_event

    def status(reason):
        return {"phase": "Pending", "conditions": [{"type": "Ready", "reason": reason, "message": "m"}]}

    assert phase_event("a", status("NoReadyReplicas"), status("PoolNotFound")).is_warning
    assert phase_event("a", status("PoolNotFound"), status("PoolNotFound")) is None
    assert phase_event("a", status("InsufficientCapacity"), status("NoReadyReplicas")) is None


async def test_a_deleted_owned_object_asks_its_pool_for_a_heal(runtime_for):
    runtime = runtime_for(FakeKube())
    memo = kopf.Memo(runtime=runtime)
    labels = {"kubelora.io/pool": "p", "app.kubernetes.io/managed-by": "kubelora-operator"}
    await handlers.on_owned_event(event={"type": "DELETED"}, labels=labels, namespace="ns", memo=memo)
    assert not runtime.take_heal_request("ns", "p")  # no daemon for the pool (yet, or any more): nothing to ask
    wake = runtime.trigger_for("ns", "p")
    for kind in ("ADDED", "MODIFIED", None):  # kopf's listing and our own applies: no heal
        await handlers.on_owned_event(event={"type": kind}, labels=labels, namespace="ns", memo=memo)
    assert not wake.is_set() and not runtime.take_heal_request("ns", "p")
    await handlers.on_owned_event(event={"type": "DELETED"}, labels=labels, namespace="ns", memo=memo)
    assert wake.is_set() and runtime.take_heal_request("ns", "p") and not runtime.take_heal_request("ns", "p")
    assert {plural for _, _, plural in handlers.OWNED_KINDS} == {
        "deployments", "services", "serviceaccounts", "configmaps", "roles", "rolebindings", "networkpolicies"}
