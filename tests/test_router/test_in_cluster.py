"""The router as a pod of the local cluster: in-cluster config, a Role that grants only `get` on its placement
ConfigMap, replicas reached by pod IP. A small aiohttp app stands in for an engine pod.

Steps: fake engine pod -> placement ConfigMap naming its pod IP -> router pod (settings from KUBELORA_ROUTER_*
variables) Ready through its /ready probe -> a completion through the router reaches the engine pod -> a
ConfigMap update reaches the router's /v1/models within seconds.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid

from pytest_cluster import wait_for

from kubelora.operator.settings import VERSION

# The image make images builds; its venv's python has aiohttp, so the fake engine runs on it too.
ROUTER_IMAGE = f"kubelora-operator:{VERSION}"  # the control-plane image, with the router command

FAKE_ENGINE = """
import os
from aiohttp import web

async def complete(request):
    body = await request.json()
    return web.json_response({"object": "text_completion", "model": body["model"], "pod": os.environ["POD_NAME"],
                              "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]})

app = web.Application()
app.router.add_post("/v1/completions", complete)
web.run_app(app, host="0.0.0.0", port=8000, print=None)
"""


def _manifests(namespace: str) -> list[dict]:
    meta = {"namespace": namespace}
    pod_name = {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "fake-engine", **meta},
         "data": {"engine.py": FAKE_ENGINE}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "demo-engine-0", **meta},
         "spec": {"containers": [{"name": "engine", "image": ROUTER_IMAGE, "command": ["python3", "/app/engine.py"],
                                  "env": [pod_name], "volumeMounts": [{"name": "app", "mountPath": "/app"}],
                                  "readinessProbe": {"tcpSocket": {"port": 8000}, "periodSeconds": 1}}],
                  "volumes": [{"name": "app", "configMap": {"name": "fake-engine"}}]}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "demo-router", **meta}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "demo-router", **meta},
         "rules": [{"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["demo-placement"],
                    "verbs": ["get"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "demo-router", **meta},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "demo-router"},
         "subjects": [{"kind": "ServiceAccount", "name": "demo-router", "namespace": namespace}]},
    ]


def _router_pod(namespace: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "demo-router", "namespace": namespace},
            "spec": {"serviceAccountName": "demo-router",
                     "containers": [{"name": "router", "image": ROUTER_IMAGE, "args": ["router"],
                                     "env": [{"name": "KUBELORA_ROUTER_POOL", "value": "demo"},
                                             {"name": "KUBELORA_ROUTER_POLL_INTERVAL", "value": "0.5"}],
                                     "readinessProbe": {"httpGet": {"path": "/ready", "port": 8080},
                                                        "periodSeconds": 1}}]}}


def _placement_configmap(namespace: str, engine_ip: str, adapters: dict, revision: int) -> dict:
    placement = {"pool": "demo", "baseModel": "base", "revision": revision, "adapters": adapters,
                 "replicas": [{"pod": "demo-engine-0", "url": f"http://{engine_ip}:8000", "ready": True}]}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "demo-placement", "namespace": namespace},
            "data": {"placement.json": json.dumps(placement)}}


def _ready_ip(cluster, namespace: str, pod: str) -> str | None:
    status = cluster.get_json("pod", pod, "-n", namespace).get("status", {})
    is_ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", []))
    return status.get("podIP") if is_ready else None


def _http(url: str, body: dict | None = None) -> tuple[int, dict, dict]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def test_router_pod_reads_its_configmap_and_routes_by_pod_ip(cluster):
    namespace = f"klr-router-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", namespace)
    try:
        for manifest in _manifests(namespace):
            cluster.apply(json.dumps(manifest))
        engine_ip = wait_for("fake engine Ready", lambda: _ready_ip(cluster, namespace, "demo-engine-0"))
        cluster.apply(json.dumps(_placement_configmap(namespace, engine_ip, {"a": ["demo-engine-0"]}, 1)))
        cluster.apply(json.dumps(_router_pod(namespace)))
        router_ip = wait_for("router Ready", lambda: _ready_ip(cluster, namespace, "demo-router"), timeout_s=120)
        router = f"http://{router_ip}:8080"

        status, headers, body = _http(router + "/v1/completions", {"model": "a", "prompt": "hi"})
        assert status == 200 and body["pod"] == "demo-engine-0" and headers["X-Kubelora-Replica"] == "demo-engine-0"
        status, _, body = _http(router + "/v1/completions", {"model": "b", "prompt": "hi"})
        assert status == 404 and body["error"]["code"] == "model_not_found"

        cluster.apply(json.dumps(_placement_configmap(namespace, engine_ip, {"a": ["demo-engine-0"], "b": []}, 2)))
        wait_for("placement revision 2 in the router",
                 lambda: [m["id"] for m in _http(router + "/v1/models")[2]["data"]] == ["base", "a", "b"],
                 timeout_s=30)
        status, headers, _ = _http(router + "/v1/completions", {"model": "b", "prompt": "hi"})
        assert status == 200 and headers["X-Kubelora-Replica"] == "demo-engine-0"  # the home of an unheld adapter
        logs = cluster.kubectl("logs", "demo-router", "-n", namespace).stdout
        events = [json.loads(line) for line in logs.splitlines() if line.startswith("{")]
        assert [e["revision"] for e in events if e["event"] == "placement_updated"] == [1, 2]
        assert not [e for e in events if e["event"] == "placement_read_failed"]  # get on one name was enough
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--timeout=90s", check=False)


def test_configmap_source_with_a_kubeconfig(cluster):
    """The out-of-cluster path (--kubeconfig): missing ConfigMap, then created, unchanged, updated, broken."""
    from kubelora.router.sources import ConfigMapSource, PlacementStore

    namespace = f"klr-router-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", namespace)
    try:
        store = PlacementStore()
        source = ConfigMapSource(namespace, "demo-placement", str(cluster.kubeconfig), poll_interval=1.0)
        source.poll(store)
        source.poll(store)
        assert store.placement is None and store.num_errors == 1  # 404, logged once
        cluster.apply(json.dumps(_placement_configmap(namespace, "10.0.0.1", {"a": []}, 1)))
        source.poll(store)
        source.poll(store)
        assert store.placement.revision == 1 and store.num_updates == 1  # same resourceVersion: no re-parse
        cluster.apply(json.dumps(_placement_configmap(namespace, "10.0.0.1", {"a": [], "b": []}, 2)))
        source.poll(store)
        assert store.placement.revision == 2 and sorted(store.placement.adapters) == ["a", "b"]
        broken = _placement_configmap(namespace, "10.0.0.1", {}, 3)
        broken["data"]["placement.json"] = "{"
        cluster.apply(json.dumps(broken))
        source.poll(store)
        assert store.placement.revision == 2 and store.num_errors == 2  # the last good placement stays
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--timeout=90s", check=False)
