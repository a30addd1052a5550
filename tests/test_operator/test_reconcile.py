"""The pool reconcile against fake engines (aiohttp servers with the engine's admin API) and a fake API server.

Failure modes from DESIGN.md: a bad adapter fails alone and is not retried; transient engine errors back
off and heal; a restarted (empty) pod and manual drift heal the same way; a deleted adapter is unloaded.
"""
from __future__ import annotations

import asyncio
import json
import copy

import aiohttp
import pytest
from aiohttp import web

from kubelora.operator import names
from kubelora.operator import observe as observe_module
from kubelora.operator.builders import admin_token_digest
from kubelora.operator.plan import DesiredAdapter
from kubelora.operator.reconcile import PoolReconciler
from kubelora.operator.settings import OperatorSettings
from kubelora.operator.specs import pool_fingerprint

NS = "ns"


class FakeEngine:
    def __init__(self) -> None:
        self.adapters: dict[str, dict] = {}
        self.calls: list[tuple[str, str]] = []
        self.fail_next: dict[str, int] = {}  # adapter -> number of 503s still to answer
        self.payloads: list[dict] = []  # every load request's body
        self.token: str | None = None  # the admin token it was started with: 401 without it

    def app(self) -> web.Application:
        @web.middleware
        async def admin_token(request, handler):
            if self.token is not None and request.headers.get("Authorization") != f"Bearer {self.token}":
                return web.json_response({"error": {"type": "unauthorized", "message": "admin token"}}, status=401)
            return await handler(request)

        app = web.Application(middlewares=[admin_token])
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/load_lora_adapter", self.load)
        app.router.add_post("/v1/unload_lora_adapter", self.unload)
        return app

    async def models(self, request):
        return web.json_response({"data": [{"id": "base", "parent": None}] + list(self.adapters.values())})

    async def load(self, request):
        body = await request.json()
        name = body["lora_name"]
        self.calls.append(("load", name))
        self.payloads.append(body)
        if "big" in body["lora_path"]:
            return web.json_response({"error": {"type": "adapter_load_error", "code": "adapter_rank_too_large",
                                                "message": "r: rank 16 exceeds max_lora_rank 8"}}, status=400)
        if self.fail_next.get(name):
            self.fail_next[name] -= 1
            return web.json_response({"error": {"type": "server_error", "message": "boom"}}, status=503)
        card = {"id": name, "parent": "base", "source": body["lora_path"], "sha256": body.get("sha256"),
                "revision": body["lora_path"][-6:],
                "residency": "host" if body.get("preload", True) else "known", "created": 1}
        self.adapters[name] = card
        return web.json_response({"adapter": card, "was_loaded": False})

    async def unload(self, request):
        name = (await request.json())["lora_name"]
        self.calls.append(("unload", name))
        return web.json_response({"was_loaded": self.adapters.pop(name, None) is not None})


class FakeKube:
    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict] = {}
        self.pods: list[dict] = []
        self.applied: dict[str, dict] = {}
        self.events: list[tuple[str, str, str]] = []
        self.secrets: dict[tuple[str, str], str] = {}  # (name, key) -> value
        self.deployments: list[dict] = []  # every Deployment applied, in order
        self.deleted: list[tuple[str, str]] = []  # (kind, name) of every delete, in order

    async def get_custom(self, plural, namespace, name):
        found = self.objects.get((plural, name))
        return copy.deepcopy(found) if found else None

    async def list_custom(self, plural, namespace):
        return [copy.deepcopy(o) for (p, _), o in sorted(self.objects.items()) if p == plural]

    async def list_pods(self, namespace, selector):
        return copy.deepcopy(self.pods)

    async def get(self, kind, namespace, name):
        return copy.deepcopy(self.applied.get(name))

    async def apply(self, manifest):
        self.applied[manifest["metadata"]["name"]] = manifest
        if manifest["kind"] == "Deployment":
            self.deployments.append(manifest)

    async def delete(self, kind, namespace, name):
        self.deleted.append((kind, name))
        return self.applied.get(name, {}).get("kind") == kind and self.applied.pop(name) is not None

    async def create(self, manifest):
        """Only Secrets are created by the reconcile (the pool's admin token); False when it exists."""
        assert manifest["kind"] == "Secret", manifest["kind"]
        name = manifest["metadata"]["name"]
        if any(secret == name for secret, _ in self.secrets):
            return False
        self.secrets.update({(name, key): value for key, value in manifest["stringData"].items()})
        return True

    async def patch_status(self, plural, namespace, name, status):
        if (plural, name) in self.objects:
            self.objects[(plural, name)]["status"] = {**self.objects[(plural, name)].get("status", {}), **status}

    async def read_secret_key(self, namespace, name, key):
        return self.secrets.get((name, key))

    async def read_secret_data(self, namespace, name):
        data = {key: value for (secret, key), value in self.secrets.items() if secret == name}
        return data or None

    async def create_event(self, involved, event_type, reason, message):
        self.events.append((involved["metadata"]["name"], event_type, reason))

    def add_adapter(self, name, path, replicas=1):
        self.objects[("loraadapters", name)] = {
            "apiVersion": "kubelora.io/v1alpha1", "kind": "LoRAAdapter",
            "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "generation": 1},
            "spec": {"pool": "p", "source": {"path": path}, "replicas": replicas}}

    def status(self, name):
        return self.objects[("loraadapters", name)].get("status", {})

    def roll_pods(self):
        """What a finished rollout leaves: every engine pod made from the pool's current spec."""
        fingerprint = pool_fingerprint(self.objects[("lorapools", "p")])
        for p in self.pods:
            p["metadata"]["annotations"][names.ANNOTATION_POOL_SPEC] = fingerprint


async def serve_engines(aiohttp_server, kube, engines: dict) -> None:
    """Each fake engine on its own HTTP server, as a ready pod of the pool."""
    for name, engine in engines.items():
        server = await aiohttp_server(engine.app())
        kube.pods.append(pod(name, str(server.make_url("")).rstrip("/")))
    kube.roll_pods()


def pool_object(max_loras: int, max_cpu_loras: int, **spec) -> dict:
    """The LoRAPool `p` as the API server holds it (for the fake Kubernetes)."""
    return {"apiVersion": "kubelora.io/v1alpha1", "kind": "LoRAPool",
            "metadata": {"name": "p", "namespace": NS, "uid": "uid-p", "generation": 1},
            "spec": {"model": {"path": "/models/base"}, "adapterRoots": ["/adapters"], **spec,
                     "engine": {"maxLoraRank": 8, "maxLoras": max_loras, "maxCpuLoras": max_cpu_loras}}}


def pod(name: str, url: str) -> dict:
    return {"metadata": {"name": name, "annotations": {"test-url": url}},
            "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}


@pytest.fixture
async def world(aiohttp_server, monkeypatch):
    monkeypatch.setattr(observe_module, "pod_admin_url", lambda p: p["metadata"]["annotations"]["test-url"])
    engines = {name: FakeEngine() for name in ("e0", "e1")}
    kube = FakeKube()
    kube.objects[("lorapools", "p")] = pool_object(2, 4, adapterUrlHosts=["models.example"])
    await serve_engines(aiohttp_server, kube, engines)
    async with aiohttp.ClientSession() as session:
        settings = OperatorSettings(backoff_initial_s=0.01, backoff_max_s=0.01)
        yield kube, engines, PoolReconciler(kube, session, settings, NS, "p")


async def test_places_preloads_registers_and_publishes(world):
    kube, engines, reconciler = world
    kube.add_adapter("a", "/adapters/a", replicas="all")
    kube.add_adapter("b", "/adapters/b", replicas=1)
    await reconciler.reconcile()
    assert kube.status("a")["phase"] == "Ready" and kube.status("a")["readyReplicas"] == 2
    assert kube.status("b")["phase"] == "Ready" and kube.status("b")["desiredReplicas"] == 1
    residency = {e: {a: c["residency"] for a, c in engine.adapters.items()} for e, engine in engines.items()}
    assert all(r["a"] == "host" for r in residency.values())
    assert sorted(r["b"] for r in residency.values()) == ["host", "known"]
    import json
    placement = json.loads(kube.applied["p-placement"]["data"]["placement.json"])
    assert sorted(placement["adapters"]["a"]) == ["e0", "e1"] and len(placement["adapters"]["b"]) == 1
    pool_status = kube.objects[("lorapools", "p")]["status"]
    assert pool_status["readyReplicas"] == 2 and pool_status["numAdapters"] == 2
    calls = sum(len(e.calls) for e in engines.values())
    await reconciler.reconcile()  # converged: no more calls, same placement revision
    assert sum(len(e.calls) for e in engines.values()) == calls
    assert json.loads(kube.applied["p-placement"]["data"]["placement.json"])["revision"] == placement["revision"]


async def test_a_bad_adapter_fails_alone_and_is_not_retried(world):
    kube, engines, reconciler = world
    kube.add_adapter("big", "/adapters/big", replicas="all")
    kube.add_adapter("good", "/adapters/good", replicas="all")
    await reconciler.reconcile()
    assert kube.status("big")["phase"] == "Failed"
    assert {c["type"]: c["reason"] for c in kube.status("big")["conditions"]}["Ready"] == "AdapterRankTooLarge"
    assert kube.status("good")["phase"] == "Ready"
    attempts = sum(call == ("load", "big") for e in engines.values() for call in e.calls)
    for _ in range(3):
        await reconciler.reconcile()
    assert sum(call == ("load", "big") for e in engines.values() for call in e.calls) == attempts
    assert ("big", "Warning", "LoadFailed") in kube.events
    # A fresh reconciler (operator restart) reads the failure from the status: still no retry.
    fresh = PoolReconciler(kube, reconciler._session, reconciler._settings, NS, "p")
    await fresh.reconcile()
    assert sum(call == ("load", "big") for e in engines.values() for call in e.calls) == attempts
    assert len(kube.status("big")["failedPoolSpec"]) == 16
    # A new source is a new revision: tried again.
    kube.objects[("loraadapters", "big")]["spec"]["source"]["path"] = "/adapters/fixed"
    kube.objects[("loraadapters", "big")]["metadata"]["generation"] = 2
    await fresh.reconcile()
    assert kube.status("big")["phase"] == "Ready"
    assert kube.status("big")["failedRevision"] is None and kube.status("big")["failedPoolSpec"] is None


@pytest.mark.parametrize("is_restarted", [False, True], ids=["same-operator", "restarted-operator"])
async def test_a_changed_pool_retries_a_failed_adapter_once(world, is_restarted):
    kube, engines, reconciler = world
    kube.add_adapter("big", "/adapters/big", replicas=1)
    await reconciler.reconcile()
    assert kube.status("big")["phase"] == "Failed"

    def attempts() -> int:
        return sum(call == ("load", "big") for e in engines.values() for call in e.calls)

    first, first_spec = attempts(), kube.status("big")["failedPoolSpec"]
    pool = kube.objects[("lorapools", "p")]
    pool["spec"]["replicas"] = 3  # scaling (and the router) change nothing an engine checks: no retry
    pool["spec"]["router"] = {"enabled": True}
    await reconciler.reconcile()
    assert attempts() == first
    # The engine settings change. Until the rollout ends, a refusal by a pod of the old spec is not final.
    pool["spec"]["engine"]["maxLoraRank"] = 16
    for _ in range(2):
        await reconciler.reconcile()
    assert attempts() > first and kube.status("big")["phase"] != "Failed"
    kube.roll_pods()
    if is_restarted:
        reconciler = PoolReconciler(kube, reconciler._session, reconciler._settings, NS, "p")
    await asyncio.sleep(0.05)  # past the retry backoff of the stale pods' refusals
    await reconciler.reconcile()  # pods of the new spec refuse it too (this fake engine always does): final
    assert kube.status("big")["phase"] == "Failed" and kube.status("big")["failedPoolSpec"] != first_spec
    final = attempts()
    for _ in range(3):
        await reconciler.reconcile()
    assert attempts() == final


async def test_source_credentials_come_from_a_secret(world):
    kube, engines, reconciler = world
    kube.add_adapter("ok", "/adapters/ok")
    kube.add_adapter("private", "/unused")
    kube.objects[("loraadapters", "private")]["spec"]["source"] = {
        "url": "https://models.example/private", "authSecretRef": {"name": "creds"}}

    def loads_of(name: str) -> list[dict]:
        return [p for e in engines.values() for p in e.payloads if p["lora_name"] == name]

    await reconciler.reconcile()  # the Secret does not exist yet: nothing is sent, the others load
    assert kube.status("private")["phase"] == "Failed" and not loads_of("private")
    assert {c["type"]: c["reason"] for c in kube.status("private")["conditions"]}["Ready"] == "SecretNotFound"
    assert kube.status("private")["failedRevision"] is None and kube.status("ok")["phase"] == "Ready"
    kube.secrets[("creds", "token")] = "tok-1"
    await reconciler.reconcile()
    assert kube.status("private")["phase"] == "Ready"
    assert {p.get("auth_token") for p in loads_of("private")} == {"tok-1"}
    assert all("auth_token" not in p for p in loads_of("ok"))
    assert "tok-1" not in repr(DesiredAdapter("private", "https://models.example/private", None, "r", "tok-1"))
    # The Secret goes away: the pods keep what they hold, nothing is unloaded, the status says why.
    del kube.secrets[("creds", "token")]
    await reconciler.reconcile()
    assert kube.status("private")["phase"] == "Failed"
    assert not any(call == ("unload", "private") for e in engines.values() for call in e.calls)
    assert any("private" in e.adapters for e in engines.values())


async def test_s3_credentials_come_from_a_secret_and_travel_as_the_s3_field(world):
    kube, engines, reconciler = world
    kube.objects[("lorapools", "p")] = pool_object(2, 4, adapterS3Buckets=["team-a"],
                                                   adapterS3Endpoints=["http://minio:9000"])
    kube.add_adapter("s3a", "/unused")
    kube.objects[("loraadapters", "s3a")]["spec"]["source"] = {
        "url": "s3://team-a/s3a.tar.gz", "authSecretRef": {"name": "s3-creds"}, "s3": {"endpoint": "http://minio:9000"}}

    def loads() -> list[dict]:
        return [p for e in engines.values() for p in e.payloads if p["lora_name"] == "s3a"]

    kube.secrets[("s3-creds", "AWS_ACCESS_KEY_ID")] = "AK"  # half a key pair: blocked, nothing sent
    await reconciler.reconcile()
    assert kube.status("s3a")["phase"] == "Failed" and not loads()
    kube.secrets[("s3-creds", "AWS_SECRET_ACCESS_KEY")] = "SK"
    kube.secrets[("s3-creds", "AWS_REGION")] = "eu-west-1"
    await reconciler.reconcile()
    assert kube.status("s3a")["phase"] == "Ready"
    assert {json.dumps(p["s3"], sort_keys=True) for p in loads()} == {json.dumps(
        {"endpoint": "http://minio:9000", "region": "eu-west-1", "access_key_id": "AK", "secret_access_key": "SK"},
        sort_keys=True)}
    assert all("auth_token" not in p for p in loads())


async def test_transient_errors_back_off_and_heal(world):
    kube, engines, reconciler = world
    kube.add_adapter("a", "/adapters/a", replicas="all")
    engines["e0"].fail_next["a"] = 2
    await reconciler.reconcile()
    status = kube.status("a")
    assert status["phase"] == "Degraded" and any(r.get("lastError") for r in status["replicas"])
    import asyncio
    for _ in range(5):
        await asyncio.sleep(0.02)
        await reconciler.reconcile()
    assert kube.status("a")["phase"] == "Ready"


async def test_restarted_pod_drift_and_deletion_heal(world):
    kube, engines, reconciler = world
    kube.add_adapter("a", "/adapters/a", replicas="all")
    await reconciler.reconcile()
    engines["e1"].adapters.clear()  # the engine restarted and lost everything
    engines["e0"].adapters["manual"] = {"id": "manual", "parent": "base", "source": "/x", "residency": "host"}
    await reconciler.reconcile()
    assert "a" in engines["e1"].adapters and "manual" not in engines["e0"].adapters
    kube.objects[("loraadapters", "a")]["spec"]["source"]["path"] = "/adapters/a2"
    await reconciler.reconcile()
    assert all(e.adapters["a"]["source"] == "/adapters/a2" for e in engines.values())
    assert {r["revision"] for r in kube.status("a")["replicas"]} == {kube.status("a")["revision"]}
    del kube.objects[("loraadapters", "a")]
    await reconciler.reconcile()
    assert all("a" not in e.adapters for e in engines.values())


async def test_unreachable_pod_is_skipped_not_fatal(world):
    kube, engines, reconciler = world
    kube.pods.append(pod("gone", "http://127.0.0.1:9"))
    kube.add_adapter("a", "/adapters/a", replicas="all")
    await reconciler.reconcile()
    status = kube.status("a")
    assert status["phase"] == "Ready" and status["desiredReplicas"] == 2
    assert {p["name"]: p["ready"] for p in kube.objects[("lorapools", "p")]["status"]["pods"]}["gone"] is False


async def test_hundreds_of_adapters_converge_in_one_run_then_cost_no_calls(world):
    kube, engines, reconciler = world
    kube.objects[("lorapools", "p")]["spec"]["engine"]["maxCpuLoras"] = 200
    for i in range(300):
        kube.add_adapter(f"t{i:03d}", f"/adapters/t{i:03d}", replicas=1)
    await reconciler.reconcile()
    phases = {kube.status(f"t{i:03d}")["phase"] for i in range(300)}
    assert phases == {"Ready"}
    assert all(len(e.adapters) == 300 for e in engines.values())  # every adapter registered everywhere
    preloaded = sum(c["residency"] == "host" for e in engines.values() for c in e.adapters.values())
    assert preloaded == 300  # one placed copy each, within capacity 200 per pod
    calls = sum(len(e.calls) for e in engines.values())
    await reconciler.reconcile()
    assert sum(len(e.calls) for e in engines.values()) == calls


def _token_digest(deployment: dict) -> str | None:
    return deployment["spec"]["template"]["metadata"]["annotations"].get(names.ANNOTATION_ADMIN_TOKEN)


async def test_a_deleted_admin_token_secret_is_recreated_and_rolls_the_engines(world):
    kube, engines, reconciler = world
    kube.add_adapter("a", "/adapters/a", replicas="all")
    await reconciler.reconcile()  # this fake starts without the Secret (on_pool_spec creates it): made here
    first = kube.secrets[(names.admin_token_secret_name("p"), names.ADMIN_TOKEN_KEY)]
    assert reconciler.admin_token == first and _token_digest(kube.deployments[-1]) == admin_token_digest(first)
    await reconciler.reconcile()
    applied = len(kube.deployments)
    assert reconciler.admin_token == first and len(kube.deployments) == applied  # nothing new within the resync
    kube.secrets.clear()  # someone deleted it
    await reconciler.reconcile()
    second = kube.secrets[(names.admin_token_secret_name("p"), names.ADMIN_TOKEN_KEY)]
    assert second != first and reconciler.admin_token == second
    assert _token_digest(kube.deployments[-1]) == admin_token_digest(second) != admin_token_digest(first)
    kube.secrets[(names.admin_token_secret_name("p"), names.ADMIN_TOKEN_KEY)] = "rotated-by-hand"
    await reconciler.reconcile()  # a rotated value: the same pass re-applies, not the resync
    assert _token_digest(kube.deployments[-1]) == admin_token_digest("rotated-by-hand")


async def test_a_heal_request_reapplies_before_the_resync(world):
    kube, engines, reconciler = world
    kube.add_adapter("a", "/adapters/a", replicas="all")
    await reconciler.reconcile()
    requests = [True]
    reconciler._take_heal_request = lambda: bool(requests) and requests.pop()
    kube.applied.clear()
    await reconciler.reconcile()
    assert {"p-engine", "p", "p-placement"} <= set(kube.applied)  # a watch saw one deleted: all re-applied
    assert ("Deployment", "p-router") in kube.deleted  # and what the spec switched off is gone, as on a spec change
    kube.applied.clear()
    await reconciler.reconcile()
    assert kube.applied == {}  # the request was taken once


async def test_owned_objects_are_reapplied_once_per_resync(world):
    kube, engines, reconciler = world
    kube.add_adapter("a", "/adapters/a", replicas="all")
    await reconciler.reconcile()
    placement = kube.applied.pop("p-placement")  # someone deleted the placement ConfigMap, and the Services
    kube.applied.clear()
    await reconciler.reconcile()
    assert kube.applied == {}  # within the resync: nothing is re-applied
    reconciler._healed_at -= reconciler._settings.resync_s  # one resync later
    await reconciler.reconcile()
    assert {"p-engine", "p", "p-placement"} <= set(kube.applied)
    assert kube.applied["p-placement"]["data"] == placement["data"]  # the same payload and revision
    assert kube.applied["p-engine"]["kind"] in ("Deployment", "Service", "NetworkPolicy")


def _start_with_token(kube, engines, token):
    """What a pod made from the Deployment carrying `token`'s digest is: an engine that answers only to it."""
    for p in kube.pods:
        if p["metadata"]["name"] in engines:
            engines[p["metadata"]["name"]].token = token
            p["metadata"]["annotations"][names.ANNOTATION_ADMIN_TOKEN] = admin_token_digest(token)


def _placement(kube) -> dict:
    return json.loads(kube.applied["p-placement"]["data"]["placement.json"])


async def test_a_rotated_token_keeps_the_old_pods_observed_and_placed_until_they_go(world, aiohttp_server):
    kube, engines, reconciler = world
    kube.add_adapter("a", "/adapters/a", replicas="all")
    await reconciler.reconcile()  # creates the Secret
    first = kube.secrets[(names.admin_token_secret_name("p"), names.ADMIN_TOKEN_KEY)]
    _start_with_token(kube, engines, first)
    await reconciler.reconcile()
    assert kube.status("a")["phase"] == "Ready"
    kube.secrets.clear()  # rotate: delete the generated Secret
    await reconciler.reconcile()
    second = kube.secrets[(names.admin_token_secret_name("p"), names.ADMIN_TOKEN_KEY)]
    assert second != first
    placement = _placement(kube)  # the old pods still serve: ready and holding it
    assert {r["pod"]: r["ready"] for r in placement["replicas"]} == {"e0": True, "e1": True}
    assert placement["adapters"]["a"] == ["e0", "e1"] and kube.status("a")["phase"] == "Ready"
    new = FakeEngine()  # the rollout's first new pod, started with the new token
    server = await aiohttp_server(new.app())
    kube.pods.append(pod("e2", str(server.make_url("")).rstrip("/")))
    kube.roll_pods()
    engines["e2"] = new
    _start_with_token(kube, {"e2": new}, second)
    await reconciler.reconcile()
    assert "a" in new.adapters and _placement(kube)["adapters"]["a"] == ["e0", "e1", "e2"]
    urls = reconciler.observed_urls  # what the pod watchers long-poll, each with its pod's token
    assert reconciler.observed_tokens == {urls["e0"]: first, urls["e1"]: first, urls["e2"]: second}
    kube.pods = [p for p in kube.pods if p["metadata"]["name"] == "e2"]  # the old pods are gone
    await reconciler.reconcile()
    assert reconciler._tokens == {admin_token_digest(second): second}  # the old token is forgotten
    assert _placement(kube)["adapters"]["a"] == ["e2"] and kube.status("a")["phase"] == "Ready"


async def test_an_operator_restarted_during_a_rotation_calls_the_old_pods_with_their_token(world):
    """The generated Secret made at a rotation keeps the tokens pods still run with, so a new operator process
    (no memory) calls each pod with its own: the old pods stay observed, and take new adapters."""
    kube, engines, reconciler = world
    kube.add_adapter("a", "/adapters/a", replicas="all")
    await reconciler.reconcile()
    first = kube.secrets[(names.admin_token_secret_name("p"), names.ADMIN_TOKEN_KEY)]
    _start_with_token(kube, engines, first)
    await reconciler.reconcile()
    kube.secrets.clear()  # rotate: delete the generated Secret; this operator makes the new one
    await reconciler.reconcile()
    second = kube.secrets[(names.admin_token_secret_name("p"), names.ADMIN_TOKEN_KEY)]
    kept = kube.secrets[(names.admin_token_secret_name("p"), names.PREVIOUS_TOKEN_PREFIX + admin_token_digest(first))]
    assert second != first and kept == first
    restarted = PoolReconciler(kube, reconciler._session, reconciler._settings, NS, "p")
    kube.add_adapter("b", "/adapters/b", replicas="all")
    await restarted.reconcile()
    assert restarted.observed_tokens == {restarted.observed_urls["e0"]: first, restarted.observed_urls["e1"]: first}
    assert _placement(kube)["adapters"]["b"] == ["e0", "e1"] and all("b" in e.adapters for e in engines.values())
    kube.pods = []  # the old pods are gone: the old token is forgotten (the Secret keeps it, unused)
    await restarted.reconcile()
    assert restarted._tokens == {admin_token_digest(second): second}


async def test_pods_refusing_an_unknown_token_keep_their_published_holdings(world):
    kube, engines, reconciler = world
    kube.add_adapter("a", "/adapters/a", replicas="all")
    await reconciler.reconcile()
    old = kube.secrets[(names.admin_token_secret_name("p"), names.ADMIN_TOKEN_KEY)]
    _start_with_token(kube, engines, old)
    await reconciler.reconcile()
    kube.secrets[(names.admin_token_secret_name("p"), names.ADMIN_TOKEN_KEY)] = "rotated-while-away"
    restarted = PoolReconciler(kube, reconciler._session, reconciler._settings, NS, "p")  # never saw `old`
    for _ in range(2):  # the first pass reads the ConfigMap, the next one its own publication
        await restarted.reconcile()
        placement = _placement(kube)
        assert {r["pod"]: r["ready"] for r in placement["replicas"]} == {"e0": True, "e1": True}
        assert placement["adapters"]["a"] == ["e0", "e1"]
    assert not any(call[0] == "unload" for e in engines.values() for call in e.calls)
    kube.add_adapter("b", "/adapters/b", replicas="all")
    await restarted.reconcile()
    assert _placement(kube)["adapters"]["b"] == []  # nothing readable holds it: not listed on unreadable pods


def test_engine_pods_marked_not_ready_by_the_node_controller_stay_observed():
    """After an API-server outage the node-lifecycle controller sets Ready=False on the node's pods and leaves
    ContainersReady (the kubelet writes both, and Ready back soon); a pod whose containers are not ready, or that
    is being deleted, is not asked."""
    ready = pod("e0", "http://e0")
    marked = copy.deepcopy(ready)
    marked["status"]["conditions"] = [{"type": "Ready", "status": "False"},
                                      {"type": "ContainersReady", "status": "True"}]
    starting = copy.deepcopy(marked)
    starting["status"]["conditions"][1]["status"] = "False"
    deleting = copy.deepcopy(marked)
    deleting["metadata"]["deletionTimestamp"] = "2026-12-07T00:00:00Z"
    assert observe_module.is_engine_serving(ready) and observe_module.is_engine_serving(marked)
    assert not observe_module.is_engine_serving(starting) and not observe_module.is_engine_serving(deleting)
    assert not observe_module.is_pod_ready(marked)  # routers and the rest read Ready as it is


async def test_a_node_controller_not_ready_mark_keeps_the_engines_published_ready(world):
    kube, engines, reconciler = world
    kube.add_adapter("a", "/adapters/a", replicas="all")
    await reconciler.reconcile()
    for p in kube.pods:
        p["status"]["conditions"] = [{"type": "Ready", "status": "False"},
                                     {"type": "ContainersReady", "status": "True"}]
    await reconciler.reconcile()
    placement = _placement(kube)
    assert {r["pod"]: r["ready"] for r in placement["replicas"]} == {"e0": True, "e1": True}
    assert placement["adapters"]["a"] == ["e0", "e1"] and kube.status("a")["phase"] == "Ready"


async def test_the_metered_reconcile_counts_passes_calls_placements_and_phases(world):
    from prometheus_client import generate_latest

    from kubelora.operator.metered import MeteredReconciler
    from kubelora.operator.metrics import OperatorMetrics

    kube, engines, plain = world
    metrics = OperatorMetrics()
    reconciler = MeteredReconciler(kube, plain._session, plain._settings, NS, "p", metrics=metrics)
    kube.add_adapter("a", "/adapters/a", replicas="all")
    kube.add_adapter("big", "/adapters/big", replicas=1)  # the engine refuses it: Failed
    await reconciler.reconcile()
    await reconciler.reconcile()  # converged: no calls, no new placement

    def sample(name: str, **labels) -> float | None:
        return metrics.registry.get_sample_value(name, {"namespace": NS, "pool": "p", **labels})

    assert sample("kubelora_operator_reconcile_passes_total") == 2
    assert sample("kubelora_operator_reconcile_errors_total") == 0
    assert sample("kubelora_operator_engine_calls_total", call="load", result="ok") == 2  # "a" on both pods
    refused = sum(call == ("load", "big") for e in engines.values() for call in e.calls)
    assert refused >= 1 and sample("kubelora_operator_engine_calls_total", call="load", result="error") == refused
    assert sample("kubelora_operator_placement_changes_total") == 1
    assert sample("kubelora_operator_adapters", phase="Ready") == 1
    assert sample("kubelora_operator_adapters", phase="Failed") == 1
    assert sample("kubelora_operator_pool_condition", condition="Ready") == 1
    del kube.objects[("loraadapters", "a")]
    await reconciler.reconcile()
    assert sample("kubelora_operator_engine_calls_total", call="unload", result="ok") == 2
    kube.get_custom = _raise  # the API server fails: the pass is counted as an error
    with pytest.raises(aiohttp.ClientError):
        await reconciler.reconcile()
    assert sample("kubelora_operator_reconcile_errors_total") == 1
    assert b"kubelora_operator_reconcile_duration_seconds_count" in generate_latest(metrics.registry)


async def _raise(*_args, **_kwargs):
    raise aiohttp.ClientConnectionError("refused")
