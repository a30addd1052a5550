"""Copies that follow demand on a real API server (operator resync 2 s): two `replicas: auto` adapters start at
one copy each; a load step on one raises its copies to every engine within a few passes while the other stays at
one, the router spreads the hot adapter's concurrent requests over its copies, and no request fails."""
from __future__ import annotations

import collections
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

from pytest_cluster import wait_for

from .conftest import adapter_manifest, pool_manifest
from .test_operator_lifecycle import ready_engine_pods

ENGINES = "kubelora.io/pool=dpool,app.kubernetes.io/component=engine"
ROUTERS = "kubelora.io/pool=dpool,app.kubernetes.io/component=router"
NUM_CLIENTS = 4


def complete(router_ip: str, model: str) -> tuple[int, str]:
    body = json.dumps({"model": model, "prompt": "hello", "max_tokens": 8, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://{router_ip}:8080/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers.get("X-Kubelora-Replica", "")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def status(env, name: str) -> dict:
    return env.cluster.get_json("loraadapter", name, "-n", env.namespace).get("status") or {}


def test_a_load_step_raises_an_auto_adapters_copies_and_the_router_spreads_it(operator_env, material) -> None:
    env = operator_env
    env.cluster.apply(pool_manifest("dpool", material, replicas=3, router=True), namespace=env.namespace)
    for name, path in (("hot", "/adapters/a1"), ("cold", "/adapters/a2")):
        env.cluster.apply(adapter_manifest(name, "dpool", path, "auto"), namespace=env.namespace)
    wait_for("3 ready engines", lambda: len(ready_engine_pods(env, ENGINES)) == 3, timeout_s=240)
    (_, router_ip), = wait_for("a ready router", lambda: ready_engine_pods(env, ROUTERS), timeout_s=120).items()
    for name in ("hot", "cold"):
        wait_for(f"{name} Ready on one copy", lambda name=name: status(env, name).get("phase") == "Ready"
                 and status(env, name).get("desiredReplicas") == 1, timeout_s=120)
    assert status(env, "hot")["desiredReason"] == "MinReplicas"

    stop, failures, answered = threading.Event(), [], collections.Counter()

    def loop() -> None:
        while not stop.is_set():
            code, replica = complete(router_ip, "hot")
            if code == 200:
                answered[replica] += 1
            else:
                failures.append((code, replica))

    clients = [threading.Thread(target=loop) for _ in range(NUM_CLIENTS)]
    started = time.monotonic()
    for client in clients:
        client.start()
    try:
        wait_for("hot on every engine", lambda: status(env, "hot").get("desiredReplicas") == 3
                 and status(env, "hot").get("readyReplicas") == 3, timeout_s=60, interval_s=0.2)
        raised_s = time.monotonic() - started
        spread_from = sum(answered.values())
        # The load bound sends a request past a copy busier than 1.25x the mean in flight: with 4 clients on 3
        # copies at least two of them answer.
        wait_for("requests answered by more than one copy", lambda: len(answered) >= 2, timeout_s=30,
                 interval_s=0.2)
    finally:
        stop.set()
        for client in clients:
            client.join(timeout=60)
    print(f"[demand-e2e] hot on 3 copies {raised_s:.1f} s after the load step; answers by replica "
          f"{dict(answered)} ({spread_from} before the third copy was Ready)", flush=True)
    assert failures == []
    assert status(env, "hot")["desiredReason"] in ("Demand", "MaxReplicas")
    assert status(env, "cold")["desiredReplicas"] == 1


def test_a_silent_router_degrades_the_pool_and_leaves_its_adapters_ready(operator_env) -> None:
    """The pool of the test above. Its router stops answering (SIGSTOP: alive, silent): the pool turns
    Degraded/RouterPlacementStale while every adapter it had acknowledged stays Ready (kubectl wait, Flux and Argo
    see no regression); once it answers again the pool is no longer Degraded."""
    env = operator_env
    router = env.cluster.get_json("pods", "-n", env.namespace, "-l", ROUTERS)["items"][0]
    pid = env.cluster.container_pid(router["metadata"]["uid"], "router")

    def degraded() -> dict | None:
        status = env.cluster.get_json("lorapool", "dpool", "-n", env.namespace).get("status") or {}
        found = next((c for c in status.get("conditions") or [] if c["type"] == "Degraded"), {})
        return found if found.get("status") == "True" else None

    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        condition = wait_for("the pool Degraded", degraded, timeout_s=60, interval_s=0.5)
        print(f"[demand-e2e] Degraded {time.monotonic() - started:.1f} s after the router went silent", flush=True)
        assert condition["reason"] == "RouterPlacementStale"
        for _ in range(10):  # several passes (resync 2 s): the adapters never leave Ready
            assert [status(env, name)["phase"] for name in ("hot", "cold")] == ["Ready", "Ready"]
            time.sleep(1)
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for("Degraded cleared", lambda: degraded() is None, timeout_s=60, interval_s=0.5)
