"""Status on a real API server: transient failures heal, kstatus conditions, declared rank checked.

- an adapter applied before its files exist is Loading (LoadRetrying) with the last error and the next retry
  time, and becomes Ready once the files are copied, without any spec edit;
- `kubectl wait --for=condition=Ready` works on both kinds, and the kstatus reading of sigs.k8s.io/cli-utils
  (the Go reader Flux uses, built through the Go module proxy) is Current;
- a spec.rank the files contradict is Failed (RankMismatch), Stalled, and not served;
- an engine refusal stays Failed until the annotation kubelora.io/retry asks for one more try;
- owned objects deleted come back (within a resync; within 5 s through the watches), and a rotated admin token
  rolls the engine pods onto it.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from gobuild import build_cached
from pytest_cluster import wait_for

from .test_operator_lifecycle import ADMIN_PORT, POOL, admin_call, ready_engine_pods, refused_status, served_adapters

ADAPTER = """
apiVersion: kubelora.io/v1alpha1
kind: LoRAAdapter
metadata: {{name: {name}}}
spec: {{pool: pool1, source: {{path: {path}}}{extra}}}
"""


def apply_adapter(env, name: str, path: str, extra: str = "") -> None:
    env.cluster.apply(ADAPTER.format(name=name, path=path, extra=extra), namespace=env.namespace)


def get(env, kind: str, name: str) -> dict:
    return env.cluster.get_json(kind, name, "-n", env.namespace)


def conditions(body: dict) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in (body.get("status") or {}).get("conditions") or []}


def kubectl_wait(env, target: str, condition: str, timeout_s: int = 90) -> None:
    env.cluster.kubectl("wait", "-n", env.namespace, target, f"--for=condition={condition}", f"--timeout={timeout_s}s",
                        timeout_s=timeout_s + 10)


KSTATUS_SOURCE = Path(__file__).resolve().parents[2] / "e2e" / "kstatus"


@pytest.fixture(scope="module")
def kstatus_reader(shown):
    """`kstatus_reader(body) -> "Current" | "InProgress" | "Failed" | ...`: e2e/kstatus, a few lines over
    sigs.k8s.io/cli-utils' kstatus, built with the Go toolchain through the module proxy (pinned by its go.sum)
    and cached by the digest of its sources (e2e/gobuild.py, which says what it builds)."""
    with shown():
        binary = build_cached("kstatus", KSTATUS_SOURCE, ("go.mod", "go.sum", "main.go"), timeout_s=900,
                              hint="about a minute the first time, cached after")

    def read(body: dict) -> str:
        result = subprocess.run([str(binary)], input=json.dumps(body), capture_output=True, text=True, check=True,
                                timeout=30)
        return result.stdout.split("\t", 1)[0]

    return read


@pytest.fixture(scope="module")
def late_dir(material):
    """An adapter directory under the pool's hostPath that does not exist when the test starts."""
    path = material.adapters_dir / "late-status-e2e"
    shutil.rmtree(path, ignore_errors=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_status_tells_the_truth(operator_env, material, adapter_server, late_dir, kstatus_reader) -> None:
    env = operator_env
    env.cluster.kubectl("create", "secret", "generic", "engine-admin", "-n", env.namespace,
                        "--from-literal=token=e2e-admin-token")
    env.cluster.apply(POOL.format(models=material.model_dir.parent, adapters=material.adapters_dir,
                                  url_host=adapter_server.split(":")[0]), namespace=env.namespace)
    apply_adapter(env, "a1", "/adapters/a1")
    apply_adapter(env, "late", f"/adapters/{late_dir.name}")
    apply_adapter(env, "liar", "/adapters/a1", ", rank: 8")  # a1's files have rank 4
    apply_adapter(env, "big", "/adapters/big")  # rank 16 > the pool's maxLoraRank 8: the engine refuses it

    # kstatus: Ready (with observedGeneration) for kubectl wait and Flux, on both kinds.
    kubectl_wait(env, "lorapool/pool1", "Ready", timeout_s=120)
    kubectl_wait(env, "loraadapter/a1", "Ready")
    for kind, name in (("lorapool", "pool1"), ("loraadapter", "a1")):
        body = get(env, kind, name)
        assert body["status"]["observedGeneration"] == body["metadata"]["generation"]
        assert conditions(body)["Reconciling"][0] == conditions(body)["Stalled"][0] == "False"
        assert kstatus_reader(body) == "Current", body["status"]

    # A source that is not there yet is retried with backoff, shown as Loading with the error and next retry.
    def retrying() -> dict | None:
        body = get(env, "loraadapter", "late")
        replicas = (body.get("status") or {}).get("replicas") or []
        is_retrying = body["status"].get("phase") == "Loading" and any(r.get("nextRetryAt") for r in replicas)
        return body if is_retrying else None

    late = wait_for("late adapter retrying", retrying, timeout_s=60)
    assert conditions(late)["Ready"] == ("False", "LoadRetrying")
    assert conditions(late)["Reconciling"] == ("True", "LoadRetrying")
    assert "not a directory" in late["status"]["replicas"][0]["lastError"]
    assert kstatus_reader(late) == "InProgress"
    shutil.copytree(material.adapters_dir / "a2", late_dir)  # the artifact arrives after its manifest
    kubectl_wait(env, "loraadapter/late", "Ready", timeout_s=30)  # backoff is capped at 4 s in this test's operator
    assert get(env, "loraadapter", "late")["metadata"]["generation"] == 1  # healed without any spec edit

    # A declared rank the files contradict: Failed with a reason, Stalled, not served.
    kubectl_wait(env, "loraadapter/liar", "Stalled")
    liar = get(env, "loraadapter", "liar")
    assert liar["status"]["phase"] == "Failed" and conditions(liar)["Ready"] == ("False", "RankMismatch")
    assert "spec.rank is 8" in {c["type"]: c for c in liar["status"]["conditions"]}["Ready"]["message"]
    assert kstatus_reader(liar) == "Failed"
    (pod, ip), = ready_engine_pods(env).items()
    wait_for("liar unloaded", lambda: "liar" not in served_adapters(ip), timeout_s=30)
    assert {"a1", "late"} <= set(served_adapters(ip))

    # An engine refusal stands; kubelora.io/retry with a new value asks for one more try.
    kubectl_wait(env, "loraadapter/big", "Stalled")
    big = get(env, "loraadapter", "big")
    assert conditions(big)["Ready"] == ("False", "AdapterRankTooLarge") and "retryRequest" not in big["status"]
    env.cluster.kubectl("annotate", "-n", env.namespace, "loraadapter/big", "kubelora.io/retry=first", "--overwrite")
    retried = wait_for("retry answered",
                       lambda: (b := get(env, "loraadapter", "big"))["status"].get("retryRequest") == "first" and b,
                       timeout_s=30)
    assert retried["status"]["phase"] == "Failed" and conditions(retried)["Ready"][1] == "AdapterRankTooLarge"
    events = env.cluster.get_json("events", "-n", env.namespace, "--field-selector",
                                  "involvedObject.name=big,reason=LoadFailed")["items"]
    assert sum(e.get("count") or 1 for e in events) == 2, json.dumps(events)[:2000]  # the first try and the retry

    # A full pool: maxCpuLoras 4 adapter slots on the one pod (a1, late, x1, x2); x3 finds no room. It is Pending,
    # not Loading, with a Warning event, and the pool says what is missing.
    for name in ("x1", "x2", "x3"):
        apply_adapter(env, name, "/adapters/a1")
    kubectl_wait(env, "loraadapter/x3", "Stalled")
    x3 = get(env, "loraadapter", "x3")
    assert x3["status"]["phase"] == "Pending" and conditions(x3)["Ready"] == ("False", "InsufficientCapacity")
    warnings = env.cluster.get_json("events", "-n", env.namespace, "--field-selector",
                                    "involvedObject.name=x3,reason=Pending,type=Warning")["items"]
    assert warnings and "InsufficientCapacity" in warnings[0]["message"]
    shortage = wait_for("the pool's shortage, sized",
                        lambda: (s := get(env, "lorapool", "pool1")["status"]["capacityShortage"])["bytes"] > 0 and s,
                        timeout_s=30)
    assert (shortage["numAdapters"], shortage["numCopies"]) == (1, 1)
    assert get(env, "lorapool", "pool1")["status"]["pods"][0]["adapterBudgetBytes"] > 0
    assert "x3" in served_adapters(ip)  # registered, served on demand

    # Deleting two makes room: x3 is placed and Ready; the deleted ones leave the pod.
    env.cluster.kubectl("delete", "loraadapter", "x1", "x2", "-n", env.namespace, "--timeout=60s", timeout_s=70)
    kubectl_wait(env, "loraadapter/x3", "Ready", timeout_s=30)
    assert not {"x1", "x2"} & set(served_adapters(ip))
    assert get(env, "lorapool", "pool1")["status"]["capacityShortage"]["numCopies"] == 0

    # Objects the pool owns come back within a resync (2 s in this test's operator) when deleted.
    owned = [("service", "pool1"), ("service", "pool1-engine"), ("configmap", "pool1-placement")]
    uids = {(kind, name): get(env, kind, name)["metadata"]["uid"] for kind, name in owned}
    env.cluster.kubectl("delete", "-n", env.namespace, *(f"{kind}/{name}" for kind, name in owned))

    def recreated() -> bool:
        found = env.cluster.kubectl("get", "-n", env.namespace, "-o", "json", *(f"{k}/{n}" for k, n in owned),
                                    check=False)
        if found.returncode != 0:
            return False
        items = json.loads(found.stdout).get("items") or []
        return len(items) == 3 and all(i["metadata"]["uid"] != uids[(i["kind"].lower(), i["metadata"]["name"])]
                                       for i in items)

    wait_for("owned objects recreated", recreated, timeout_s=30)
    placement = json.loads(get(env, "configmap", "pool1-placement")["data"]["placement.json"])
    assert "x3" in placement["adapters"] and placement["revision"] > 1

    # Out of band: an adapter unloaded by hand, behind the operator's back, is back within 5 s (the operator
    # long-polls each pod's adapter set; its resync is 2 s in this test's manifest, so time the repair itself).
    env.cluster.kubectl("set", "env", "-n", env.operator_namespace, "deployment/kubelora-operator",
                        "KUBELORA_OPERATOR_RESYNC_S=300")
    env.cluster.kubectl("rollout", "status", "-n", env.operator_namespace, "deployment/kubelora-operator",
                        "--timeout=90s", timeout_s=100)
    wait_for("a fresh operator's first passes", lambda: "a1" in served_adapters(ip), timeout_s=30)
    time.sleep(3)  # its watchers are started after its first pass
    admin_call(ip, "/v1/unload_lora_adapter", {"lora_name": "a1"})
    started = time.monotonic()
    wait_for("a1 repaired", lambda: served_adapters(ip).get("a1", {}).get("residency") in ("host", "device"),
             timeout_s=30, interval_s=0.1)
    assert time.monotonic() - started < 5

    # With the resync at 300 s, deleted owned objects come back through the operator's watches, within 5 s.
    owned = [("service", "pool1-engine"), ("configmap", "pool1-placement")]
    uids = {(kind, name): get(env, kind, name)["metadata"]["uid"] for kind, name in owned}
    env.cluster.kubectl("delete", "-n", env.namespace, *(f"{kind}/{name}" for kind, name in owned))
    started = time.monotonic()
    wait_for("owned objects recreated by the watches", lambda: all(
        env.cluster.kubectl("get", "-n", env.namespace, f"{kind}/{name}", "-o", "jsonpath={.metadata.uid}",
                            check=False).stdout.strip() not in ("", uids[(kind, name)]) for kind, name in owned),
             timeout_s=30, interval_s=0.2)
    assert time.monotonic() - started < 5

    # A rotated admin token rolls the engine pods onto it: the Deployment's pod template carries the token's
    # digest, re-applied by the next pass (the engines read the token only at start).
    def digest() -> str | None:
        template = get(env, "deployment", "pool1-engine")["spec"]["template"]["metadata"]
        return (template.get("annotations") or {}).get("kubelora.io/admin-token-digest")

    before, old_pods = digest(), set(ready_engine_pods(env))
    assert before == hashlib.sha256(b"e2e-admin-token").hexdigest()[:16]
    env.cluster.kubectl("patch", "secret", "engine-admin", "-n", env.namespace, "-p",
                        json.dumps({"stringData": {"token": "e2e-rotated-token"}}))
    env.cluster.kubectl("delete", "-n", env.namespace, "configmap/pool1-placement")  # a pass, through the watch
    wait_for("the new token's digest on the pod template", lambda: digest() not in (None, before), timeout_s=30)
    assert digest() == hashlib.sha256(b"e2e-rotated-token").hexdigest()[:16]
    wait_for("engine pods rolled", lambda: ready_engine_pods(env) and not set(ready_engine_pods(env)) & old_pods,
             timeout_s=180)
    [new_ip] = ready_engine_pods(env).values()
    wait_for("a1 loaded by the operator with the new token",
             lambda: served_adapters(new_ip).get("a1", {}).get("residency") in ("host", "device"), timeout_s=90)
    assert refused_status(f"http://{new_ip}:{ADMIN_PORT}/v1/unload_lora_adapter", {"lora_name": "a1"},
                          token="e2e-admin-token") == 401
