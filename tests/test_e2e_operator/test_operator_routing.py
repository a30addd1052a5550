"""Ready means routable, stale placement, on a real API server with the router reached by pod IP
(the local cluster has no kube-proxy):

- after an adapter turns `Ready`, the very next request through the router succeeds (every trial), and apply ->
  Ready stays within 2 s p50;
- with the router's placement unreadable (its ServiceAccount deleted: the token it holds no longer
  authenticates, as with a lost token mount) the pool turns Degraded/RouterPlacementStale within ~10 s, the
  pool status shows the router's revision and error, and once the adapter's holders are deleted, requests
  through the stale router still succeed on another replica of its view, which loads the adapter on demand;
- a fresh router pod takes the current placement and the condition clears;
- a new value in the admin token Secret rolls the engines while requests through the router keep succeeding;
- a 60 s API-server outage leaves the engines and the router running on their IPs and serving.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from pytest_cluster import wait_for

from .conftest import REPO
from .test_operator_lifecycle import ADMIN_TOKEN, ready_engine_pods

POOL = """
apiVersion: kubelora.io/v1alpha1
kind: LoRAPool
metadata: {{name: rpool}}
spec:
  model: {{path: /models/tiny, servedName: tiny}}
  modelVolume: {{hostPath: {models}, mountPath: /models}}
  adapterVolume: {{hostPath: {adapters}, mountPath: /adapters}}
  adapterRoots: [/adapters]
  adminTokenSecretRef: {{name: engine-admin, key: token}}
  replicas: 3
  router: {{enabled: true, replicas: 1}}
  engine: {{device: cpu, maxLoras: 2, maxLoraRank: 8, maxCpuLoras: 8, maxModelLen: 256, maxNumSeqs: 8}}
"""
ADAPTER = """
apiVersion: kubelora.io/v1alpha1
kind: LoRAAdapter
metadata: {{name: {name}}}
spec: {{pool: rpool, source: {{path: {path}}}, replicas: {replicas}}}
"""
ENGINES = "kubelora.io/pool=rpool,app.kubernetes.io/component=engine"
ROUTERS = "kubelora.io/pool=rpool,app.kubernetes.io/component=router"
NUM_TRIALS = 6


def complete(router_ip: str, model: str, timeout_s: float = 60) -> tuple[int, str]:
    """(HTTP status, the replica that answered or the error body) of one completion through the router."""
    body = json.dumps({"model": model, "prompt": "hello", "max_tokens": 2, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://{router_ip}:8080/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.headers.get("X-Kubelora-Replica", "")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def pool_status(env) -> dict:
    return env.cluster.get_json("lorapool", "rpool", "-n", env.namespace).get("status") or {}


def condition(status: dict, type_: str) -> dict:
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), {})


@pytest.fixture(scope="module")
def api(cluster):
    """A kubernetes client on the cluster (polling a status every 20 ms is what kubectl cannot do)."""
    from kubernetes import client, config

    return client.CustomObjectsApi(config.new_client_from_config(config_file=str(cluster.kubeconfig)))


def wait_ready(api, namespace: str, name: str, timeout_s: float = 60) -> float:
    """Poll the adapter every 20 ms until its phase is Ready; the time.monotonic() it was seen Ready."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        body = api.get_namespaced_custom_object("kubelora.io", "v1alpha1", namespace, "loraadapters", name)
        if (body.get("status") or {}).get("phase") == "Ready":
            return time.monotonic()
        time.sleep(0.02)
    raise AssertionError(f"{name} not Ready within {timeout_s} s: {body.get('status')}")


def test_ready_means_routable_and_a_stale_router_degrades_the_pool(operator_env, material, api) -> None:
    env = operator_env
    env.cluster.kubectl("create", "secret", "generic", "engine-admin", "-n", env.namespace,
                        f"--from-literal=token={ADMIN_TOKEN}")
    env.cluster.apply(POOL.format(models=material.model_dir.parent, adapters=material.adapters_dir),
                      namespace=env.namespace)
    wait_for("3 ready engines", lambda: len(ready_engine_pods(env, ENGINES)) == 3, timeout_s=240)
    (_, router_ip), = wait_for("a ready router", lambda: ready_engine_pods(env, ROUTERS), timeout_s=120).items()
    wait_for("the pool Ready", lambda: condition(pool_status(env), "Ready").get("status") == "True", timeout_s=60)

    # Ready means routable: the first request after Ready, through the router, succeeds.
    took = []
    for trial in range(NUM_TRIALS):
        name = f"t{trial}"
        applied = time.monotonic()
        env.cluster.apply(ADAPTER.format(name=name, path=f"/adapters/{'a1' if trial % 2 else 'a2'}", replicas=1),
                          namespace=env.namespace)
        took.append(wait_ready(api, env.namespace, name) - applied)
        status, replica = complete(router_ip, name)
        assert status == 200, f"trial {trial}: the first request after Ready got {status}: {replica}"
    print(f"[routing-e2e] apply -> Ready: {[round(t, 2) for t in took]} s", flush=True)
    assert statistics.median(took) <= 2.0
    status = pool_status(env)
    assert [(r["revision"], r["stale"]) for r in status["routers"]] == [(status["placementRevision"], False)]
    assert condition(status, "Degraded")["status"] == "False"

    # An adapter on two of the three engines; the router knows them as its holders.
    env.cluster.apply(ADAPTER.format(name="moved", path="/adapters/a1", replicas=2), namespace=env.namespace)
    wait_ready(api, env.namespace, "moved")
    holders = [r["pod"] for r in env.cluster.get_json("loraadapter", "moved", "-n", env.namespace)
               ["status"]["replicas"]]
    assert len(holders) == 2 and complete(router_ip, "moved")[0] == 200

    # The router's placement becomes unreadable: its ServiceAccount is deleted (the operator recreates it, with a
    # new UID, so the token the router holds is refused from now on).
    env.cluster.kubectl("delete", "serviceaccount", "rpool-router", "-n", env.namespace)
    started = time.monotonic()
    degraded = wait_for("the pool Degraded", lambda: (lambda c: c if c.get("status") == "True" else None)(
        condition(pool_status(env), "Degraded")), timeout_s=45)
    print(f"[routing-e2e] Degraded after {time.monotonic() - started:.1f} s: {degraded['message']}", flush=True)
    assert degraded["reason"] == "RouterPlacementStale"
    (router,) = pool_status(env)["routers"]
    assert router["stale"] and "401" in router.get("lastError", ""), router

    # The adapter's holders go away; the operator publishes a placement the router cannot read.
    stale_revision = router["revision"]
    env.cluster.kubectl("delete", "pod", *holders, "-n", env.namespace, "--timeout=90s", timeout_s=100)  # gone
    wait_for("a newer placement published", lambda: pool_status(env)["placementRevision"] > stale_revision,
             timeout_s=60)
    # Its view still names the deleted holders (the router's header names the view's pod, so which pod answered
    # is not told apart when an IP was reused): every request succeeds anyway.
    results = [complete(router_ip, "moved") for _ in range(6)]
    assert all(status == 200 for status, _ in results), results
    metrics = urllib.request.urlopen(f"http://{router_ip}:8080/metrics", timeout=10).read().decode()
    age = next(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("kubelora_router_placement_age_seconds "))
    assert age > 10
    assert condition(pool_status(env), "Degraded")["reason"] == "RouterPlacementStale"

    # A new router pod gets a valid token, takes the current placement, and the pool is no longer Degraded.
    # Degraded clears once no router is stale, which can be before the new pod has answered at all (a router
    # entry without a revision): wait for both.
    env.cluster.kubectl("delete", "pod", "-n", env.namespace, "-l", ROUTERS, "--wait=false")

    def recovered() -> dict | None:
        status = pool_status(env)
        routers_current = status.get("routers") and all(
            r.get("revision") == status["placementRevision"] and not r["stale"] for r in status["routers"])
        return status if routers_current and condition(status, "Degraded").get("status") == "False" else None

    status = wait_for("Degraded cleared, every router on the current placement", recovered, timeout_s=120)
    assert condition(status, "Degraded")["status"] == "False"


def test_a_rotated_admin_token_keeps_the_pool_in_service(operator_env, api) -> None:
    """The pool and adapters of the test above (same module, same operator). The admin token Secret gets a new
    value while requests run through the router: the engine pods roll onto it one by one, the operator keeps
    calling the old ones with the token they started with, the placement keeps them ready until they go, and
    every request succeeds (no `no_ready_replica`)."""
    env = operator_env
    (_, router_ip), = wait_for("a ready router", lambda: ready_engine_pods(env, ROUTERS), timeout_s=60).items()
    assert complete(router_ip, "t1")[0] == 200
    old_pods = set(ready_engine_pods(env, ENGINES))
    results: list[tuple[int, str]] = []
    stop = threading.Event()

    def request_loop() -> None:
        while not stop.is_set():
            results.append(complete(router_ip, "t1", timeout_s=30))
            stop.wait(0.2)

    loop = threading.Thread(target=request_loop, daemon=True)
    loop.start()
    token = "rotated-" + ADMIN_TOKEN
    env.cluster.kubectl("patch", "secret", "engine-admin", "-n", env.namespace, "-p",
                        json.dumps({"stringData": {"token": token}}))
    digest = hashlib.sha256(token.encode()).hexdigest()[:16]

    def rolled() -> bool:
        pods = env.cluster.get_json("pods", "-n", env.namespace, "-l", ENGINES)["items"]
        current = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        ready = ready_engine_pods(env, ENGINES)
        return len(ready) == 3 and not old_pods & set(ready) and all(
            p["metadata"]["annotations"].get("kubelora.io/admin-token-digest") == digest for p in current)

    try:
        started = time.monotonic()
        wait_for("the engines rolled onto the new token", rolled, timeout_s=360, interval_s=1)
        wait_ready(api, env.namespace, "t1", timeout_s=60)
        time.sleep(2)  # requests against the new pods only
    finally:
        stop.set()
        loop.join(timeout=40)
    failed = [r for r in results if r[0] != 200]
    print(f"[routing-e2e] token rotated: rolled in {time.monotonic() - started:.0f} s, {len(results)} requests, "
          f"{len(failed)} failed", flush=True)
    assert len(results) > 10 and not failed, failed[:5]



OUTAGE_S = 60.0


def test_an_api_server_outage_leaves_the_pods_serving_on_their_ips(operator_env, api) -> None:
    """The pool of the tests above. The API server is stopped for 60 s while requests run through the router,
    then started again (`e2e/cluster up`): the kubelet's failed API calls end no pod worker, so the engines and
    the router keep running on the IPs the API records, every request succeeds (during the outage and while the
    node-lifecycle controller's NotReady marks last after it), and the pool and the adapter are Ready again."""
    env = operator_env
    cluster = env.cluster
    (_, router_ip), = wait_for("a ready router", lambda: ready_engine_pods(env, ROUTERS), timeout_s=60).items()
    pool_pods = "kubelora.io/pool=rpool"
    before = {name: ip for selector in (ENGINES, ROUTERS) for name, ip in ready_engine_pods(env, selector).items()}
    assert len(before) == 4
    kubelet_log = cluster.state_dir / "logs" / "kubelet.log"
    log_offset = kubelet_log.stat().st_size
    results: list[tuple[float, int, str]] = []
    stop = threading.Event()

    def request_loop() -> None:
        while not stop.is_set():
            status, detail = complete(router_ip, "t1", timeout_s=30)
            results.append((time.monotonic(), status, detail))
            stop.wait(0.5)

    loop = threading.Thread(target=request_loop, daemon=True)
    loop.start()
    try:
        apiserver = int((cluster.state_dir / "pids" / "kube-apiserver.pid").read_text().split()[0])
        os.kill(apiserver, signal.SIGTERM)
        down_at = time.monotonic()
        time.sleep(OUTAGE_S)
        restart_at = time.monotonic()
        up = subprocess.run([sys.executable, "-P", str(REPO / "e2e" / "cluster"), "up"], capture_output=True,
                            text=True, timeout=300)
        assert up.returncode == 0, up.stderr
        up_at = time.monotonic()
        wait_for("the pool Ready again", lambda: condition(pool_status(env), "Ready").get("status") == "True",
                 timeout_s=120)
        wait_ready(api, env.namespace, "t1", timeout_s=120)
        time.sleep(3)
    finally:
        stop.set()
        loop.join(timeout=40)
    after = {name: ip for selector in (ENGINES, ROUTERS) for name, ip in ready_engine_pods(env, selector).items()}
    listed = cluster.get_json("pods", "-n", env.namespace, "-l", pool_pods)["items"]
    restarts = {p["metadata"]["name"]: [c.get("restartCount", 0) for c in p["status"].get("containerStatuses", [])]
                for p in listed}
    during = [r for r in results if down_at <= r[0] <= restart_at]
    failed = [r for r in results if r[1] != 200]
    print(f"[routing-e2e] API server down {up_at - down_at:.0f} s: {len(during)} requests meanwhile, "
          f"{len(results)} in all, failed: {[(round(t - down_at, 1), s, d[:80]) for t, s, d in failed]}; "
          f"restarts: {restarts}", flush=True)
    assert after == before  # the same pods, Ready, on the same IPs
    assert all(count == [0] for count in restarts.values()), restarts
    log_text = kubelet_log.read_text(errors="replace")[log_offset:]
    assert "Connection refused" in log_text and "worker crashed" not in log_text  # seen, and survived
    # Right after the restart the node-lifecycle controller marks the pods of the node it saw NotReady not
    # Ready until the kubelet writes its status back (docs/cluster.md); the operator keeps engines whose
    # containers are ready in the placement meanwhile (observe.is_engine_serving): no request fails, before,
    # during or after.
    assert len(during) > OUTAGE_S and not failed
