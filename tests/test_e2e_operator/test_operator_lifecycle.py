"""The operator end to end on a real API server: apply, infer, kill, scale, update, fail, delete.

One scenario in steps (each step starts from the state the previous one left), against engine pods
reached by pod IP with the openai SDK. Every wait polls with a timeout; nothing sleeps as an assertion.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import time
import urllib.error
import urllib.request

import openai
import pytest

from pytest_cluster import wait_for

PROMPT = "The operator watches the cluster"
MAX_TOKENS = 8
ENGINE_SELECTOR = "kubelora.io/pool=pool1,app.kubernetes.io/component=engine"
POOL = """
apiVersion: kubelora.io/v1alpha1
kind: LoRAPool
metadata: {{name: pool1}}
spec:
  model: {{path: /models/tiny, servedName: tiny}}
  modelVolume: {{hostPath: {models}, mountPath: /models}}
  adapterVolume: {{hostPath: {adapters}, mountPath: /adapters}}
  adapterRoots: [/adapters]
  adapterUrlHosts: ["{url_host}"]
  adminTokenSecretRef: {{name: engine-admin, key: token}}
  replicas: 1
  engine: {{device: cpu, maxLoras: 2, maxLoraRank: 8, maxCpuLoras: 4, maxModelLen: 256, maxNumSeqs: 8}}
"""
URL_ADAPTER = """
apiVersion: kubelora.io/v1alpha1
kind: LoRAAdapter
metadata: {{name: {name}}}
spec: {{pool: pool1, source: {{url: "{url}", sha256: "{sha256}"}}}}
"""
PRIVATE_ADAPTER = """
apiVersion: kubelora.io/v1alpha1
kind: LoRAAdapter
metadata: {{name: private}}
spec: {{pool: pool1, source: {{url: "{url}", authSecretRef: {{name: adapter-source}}}}}}
"""
ADAPTER = """
apiVersion: kubelora.io/v1alpha1
kind: LoRAAdapter
metadata: {{name: {name}}}
spec: {{pool: pool1, source: {{path: {path}}}, replicas: {replicas}}}
"""
ADMIN_TOKEN = "e2e-admin-token"
# The lifecycle's pool names no adminTokenSecretRef: the operator makes pool1-engine-admin. It also lets a
# monitoring namespace reach the serving port (its NetworkPolicy; the local cluster does not enforce it).
MANAGED_POOL = POOL.replace("  adminTokenSecretRef: {{name: engine-admin, key: token}}\n",
                            "  allowedClientNamespaces: [monitoring]\n")
ADMIN_PORT = 8001
ROUTER_SELECTOR = "kubelora.io/pool=pool1,app.kubernetes.io/component=router"
ENGINE_OPTIONS = dict(device="cpu", max_loras=2, max_lora_rank=8, max_cpu_loras=4, max_model_len=256)


def apply_adapter(env, name: str, path: str, replicas: str = "1") -> None:
    env.cluster.apply(ADAPTER.format(name=name, path=path, replicas=replicas), namespace=env.namespace)


def adapter(env, name: str) -> dict:
    return env.cluster.get_json("loraadapter", name, "-n", env.namespace)


def wait_phase(env, name: str, phase: str, timeout_s: float = 90) -> dict:
    env.cluster.kubectl("wait", "-n", env.namespace, f"loraadapter/{name}", f"--for=jsonpath={{.status.phase}}={phase}",
                        f"--timeout={int(timeout_s)}s", timeout_s=timeout_s + 10)
    return adapter(env, name)


def ready_engine_pods(env, selector: str = ENGINE_SELECTOR) -> dict[str, str]:
    """name -> pod IP of the pool's ready engine (or router) pods."""
    pods = env.cluster.get_json("pods", "-n", env.namespace, "-l", selector)["items"]
    ready = {}
    for pod in pods:
        conditions = pod.get("status", {}).get("conditions") or []
        if pod["metadata"].get("deletionTimestamp") is None and any(
                c["type"] == "Ready" and c["status"] == "True" for c in conditions):
            ready[pod["metadata"]["name"]] = pod["status"]["podIP"]
    return ready


def served_adapters(ip: str) -> dict[str, dict]:
    with urllib.request.urlopen(f"http://{ip}:8000/v1/models", timeout=10) as response:
        cards = json.load(response)["data"]
    return {card["id"]: card for card in cards if card.get("parent")}


def admin_call(ip: str, path: str, body: dict, token: str = ADMIN_TOKEN) -> dict:
    """POST to the engine pod's admin port with `token` (the pool's admin token)."""
    request = urllib.request.Request(f"http://{ip}:{ADMIN_PORT}{path}", method="POST", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def refused_status(url: str, body: dict, token: str | None = None) -> int:
    """The HTTP status of a POST that must fail (from the host to the pod's IP: another client than the operator)."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(url, method="POST", data=json.dumps(body).encode(), headers=headers)
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    return refused.value.code


def pool_admin_token(env) -> str:
    """The token the operator generated in the pool's Secret, checked to be owned by the pool."""
    import base64

    secret = env.cluster.get_json("secret", "pool1-engine-admin", "-n", env.namespace)
    [owner] = secret["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"]) == ("LoRAPool", "pool1"), owner
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) >= 32
    return token


def engine_network_policy(env) -> dict:
    """The pool's NetworkPolicy spec, checked to select exactly the pool's engine pods, ingress only."""
    policy = env.cluster.get_json("networkpolicy", "pool1-engine", "-n", env.namespace)
    assert policy["metadata"]["ownerReferences"][0]["name"] == "pool1"
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": {"kubelora.io/pool": "pool1",
                                                   "app.kubernetes.io/component": "engine"}}
    assert spec["policyTypes"] == ["Ingress"]
    engines = env.cluster.get_json("pods", "-n", env.namespace, "-l", ENGINE_SELECTOR)["items"]
    assert engines and all(spec["podSelector"]["matchLabels"].items() <= p["metadata"]["labels"].items()
                           for p in engines)
    return spec


def complete(ip: str, model: str, port: int = 8000) -> str:
    client = openai.OpenAI(base_url=f"http://{ip}:{port}/v1", api_key="unused", timeout=60, max_retries=0)
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0).choices[0].text


@pytest.fixture(scope="module")
def offline(material):
    """What the engine itself generates for each adapter directory (greedy), computed in this process."""
    from kubelora.engine import LLM, SamplingParams

    llm = LLM(material.model_dir, **ENGINE_OPTIONS)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    texts = {"tiny": llm.generate([PROMPT], params)[0].text}
    for name in ("a1", "a2", "a2v2"):
        llm.load_adapter(name, material.adapters_dir / name)
        texts[name] = llm.generate([PROMPT], params, adapters=name)[0].text
    return texts


class Steps:
    """Prints each step's wall time (shown with -s or on failure): the scenario's budget is a few minutes."""

    def __init__(self) -> None:
        self.started = self.last = time.monotonic()

    def __call__(self, name: str) -> None:
        now = time.monotonic()
        print(f"[operator-e2e] {now - self.started:6.1f}s (+{now - self.last:5.1f}s) {name}", flush=True)
        self.last = now


def test_operator_lifecycle(operator_env, material, offline, adapter_server, source_token) -> None:
    env = operator_env
    step = Steps()
    env.cluster.apply(MANAGED_POOL.format(models=material.model_dir.parent, adapters=material.adapters_dir,
                                          url_host=adapter_server.split(":")[0]), namespace=env.namespace)
    apply_adapter(env, "a1", "/adapters/a1", replicas="all")
    apply_adapter(env, "a2", "/adapters/a2")
    apply_adapter(env, "big", "/adapters/big")  # rank 16 > maxLoraRank 8
    digest = hashlib.sha256((material.adapters_dir / "a1" / "adapter_model.safetensors").read_bytes()).hexdigest()
    for name, path, sha256 in (("remote", "a1", digest), ("badsha", "a2", "0" * 64)):
        env.cluster.apply(URL_ADAPTER.format(name=name, url=f"http://{adapter_server}/{path}", sha256=sha256),
                          namespace=env.namespace)

    # Loaded and serving: each adapter's output is the engine's own offline output, distinct from the base.
    step("load and serve")
    a1 = wait_phase(env, "a1", "Ready", timeout_s=120)
    step("a1 ready")
    wait_phase(env, "a2", "Ready")
    failed = wait_phase(env, "big", "Failed")
    assert {c["type"]: c["reason"] for c in failed["status"]["conditions"]}["Ready"] == "AdapterRankTooLarge"
    step("big failed")
    wait_phase(env, "remote", "Ready")
    badsha = wait_phase(env, "badsha", "Failed")
    assert {c["type"]: c["reason"] for c in badsha["status"]["conditions"]}["Ready"] == "Sha256Mismatch"
    step("url adapters")
    # A private URL: the token comes from a Secret the adapter names; until the Secret exists, nothing loads.
    env.cluster.apply(PRIVATE_ADAPTER.format(url=f"http://{adapter_server}/private/a1"), namespace=env.namespace)
    waiting = wait_phase(env, "private", "Failed")
    assert {c["type"]: c["reason"] for c in waiting["status"]["conditions"]}["Ready"] == "SecretNotFound"
    env.cluster.kubectl("create", "secret", "generic", "adapter-source", "-n", env.namespace,
                        f"--from-literal=token={source_token}")
    wait_phase(env, "private", "Ready", timeout_s=90)  # picked up by the next resync
    step("private url adapter")
    (pod, ip), = ready_engine_pods(env).items()
    assert [r["pod"] for r in a1["status"]["replicas"]] == [pod]
    assert complete(ip, "a1") == offline["a1"] != offline["tiny"]
    assert complete(ip, "a2") == offline["a2"] != offline["a1"]
    assert complete(ip, "tiny") == offline["tiny"]
    assert complete(ip, "remote") == offline["a1"]  # downloaded over HTTP, sha256 checked
    assert complete(ip, "private") == offline["a1"]  # downloaded with the Secret's bearer token
    env.cluster.kubectl("delete", "loraadapter", "private", "-n", env.namespace, "--timeout=60s", timeout_s=70)
    assert "big" not in served_adapters(ip)

    # Closed by default: the serving port has no admin endpoints, the admin port wants the pool's token (which
    # the operator made and uses: everything above loaded through it).
    step("closed by default")
    token = pool_admin_token(env)
    unload = {"lora_name": "a1"}
    assert refused_status(f"http://{ip}:8000/v1/unload_lora_adapter", unload, token) == 404
    assert refused_status(f"http://{ip}:8000/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/adapters/a1"},
                          token) == 404
    assert refused_status(f"http://{ip}:{ADMIN_PORT}/v1/unload_lora_adapter", unload) == 401
    assert refused_status(f"http://{ip}:{ADMIN_PORT}/v1/unload_lora_adapter", unload, "not-the-token") == 401
    assert "a1" in served_adapters(ip)
    engine = env.cluster.get_json("deployment", "pool1-engine", "-n", env.namespace)
    [container] = engine["spec"]["template"]["spec"]["containers"]
    assert {"name": "KUBELORA_ADMIN_TOKEN", "valueFrom": {"secretKeyRef": {"name": "pool1-engine-admin",
                                                                          "key": "token"}}} in container["env"]
    assert token not in json.dumps(engine)  # the Deployment names the Secret, never the token
    spec = engine_network_policy(env)
    admin_rule, serving_rule = spec["ingress"]
    assert admin_rule == {"ports": [{"protocol": "TCP", "port": ADMIN_PORT}], "from": [{
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": env.operator_namespace}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kubelora-operator"}}}]}
    operator_pods = env.cluster.get_json("pods", "-n", env.operator_namespace, "-l",
                                         "app.kubernetes.io/name=kubelora-operator")["items"]
    assert operator_pods  # the admin rule's selector matches the running operator
    assert serving_rule == {"ports": [{"protocol": "TCP", "port": 8000}], "from": [
        {"podSelector": {}},  # no router yet: the pool's own namespace
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]}

    columns = env.cluster.kubectl("get", "loraadapters", "-n", env.namespace).stdout
    assert columns.split("\n")[0].split() == ["NAME", "POOL", "PHASE", "READY", "DESIRED", "REVISION", "AGE"]
    assert any(line.split()[:4] == ["a1", "pool1", "Ready", "1"] for line in columns.splitlines())
    pools = env.cluster.kubectl("get", "lorapools", "-n", env.namespace).stdout
    assert pools.split("\n")[0].split() == ["NAME", "MODEL", "REPLICAS", "READY", "ADAPTERS", "AGE"]
    placement = json.loads(env.cluster.get_json("configmap", "pool1-placement", "-n", env.namespace)
                           ["data"]["placement.json"])
    assert placement["adapters"]["a1"] == [pod] and placement["baseModel"] == "tiny"

    scale = json.loads(env.cluster.kubectl("get", "--raw", f"/apis/kubelora.io/v1alpha1/namespaces/{env.namespace}"
                                           "/lorapools/pool1/scale").stdout)
    assert scale["spec"]["replicas"] == 1 and "kubelora.io/pool=pool1" in scale["status"]["selector"]

    # Manual drift heals: a hand-loaded adapter is unloaded, a hand-unloaded one comes back.
    step("manual drift")
    admin_call(ip, "/v1/load_lora_adapter", {"lora_name": "rogue", "lora_path": "/adapters/a1"}, token)
    admin_call(ip, "/v1/unload_lora_adapter", {"lora_name": "a2"}, token)
    wait_for("drift healed", lambda: {"a1", "a2"} <= set(served_adapters(ip)) and "rogue" not in served_adapters(ip),
             timeout_s=60)

    # An engine crash (the kubelet restarts the container in the same pod): the empty engine is refilled.
    step("engine crash")
    pod_json = env.cluster.get_json("pod", pod, "-n", env.namespace)
    os.kill(env.cluster.container_pid(pod_json["metadata"]["uid"], "engine"), signal.SIGKILL)

    def refilled() -> bool:
        status = env.cluster.get_json("pod", pod, "-n", env.namespace)["status"]
        restarted = status["containerStatuses"][0]["restartCount"] >= 1 and pod in ready_engine_pods(env)
        refilled = {"a1", "a2"} <= set(served_adapters(ip))
        return restarted and refilled and adapter(env, "a1")["status"]["phase"] == "Ready"

    wait_for("the restarted engine refilled", refilled, timeout_s=120)
    assert complete(ip, "a2") == offline["a2"]

    # A killed engine pod: its replacement gets the adapters back, status follows the new pod.
    step("pod deleted")
    env.cluster.kubectl("delete", "pod", pod, "-n", env.namespace, "--wait=false")

    def replaced() -> bool:
        pods = ready_engine_pods(env)
        if not pods or pod in pods:
            return False
        status = adapter(env, "a1")["status"]
        (new_pod, new_ip), = pods.items()
        return (status["phase"] == "Ready" and [r["pod"] for r in status["replicas"]] == [new_pod]
                and {"a1", "a2"} <= set(served_adapters(new_ip)))

    wait_for("the adapters on the replacement pod", replaced, timeout_s=120)
    (pod, ip), = ready_engine_pods(env).items()
    assert complete(ip, "a1") == offline["a1"]

    # Scale-out: `replicas: all` lands on both pods; a2 stays on one and is registered on the other.
    step("scale out")
    env.cluster.kubectl("scale", "lorapool/pool1", "--replicas=2", "-n", env.namespace)

    def on_both() -> bool:
        status = adapter(env, "a1")["status"]
        return status["phase"] == "Ready" and status["readyReplicas"] == 2 and len(ready_engine_pods(env)) == 2

    wait_for("a1 on both replicas", on_both, timeout_s=120)
    pods = ready_engine_pods(env)
    for name, pod_ip in pods.items():
        cards = served_adapters(pod_ip)
        assert cards["a1"]["residency"] in ("host", "device") and "a2" in cards, (name, cards)
        assert complete(pod_ip, "a1") == offline["a1"]
        assert complete(pod_ip, "a2") == offline["a2"]  # on demand where it is only registered
    assert adapter(env, "a2")["status"]["desiredReplicas"] == 1
    pool_status = env.cluster.get_json("lorapool", "pool1", "-n", env.namespace)["status"]
    assert pool_status["readyReplicas"] == 2 and pool_status["numAdapters"] == 5

    # The operator restarts: it picks up where it was (no retry of the failed adapter, see the end).
    step("operator restart")
    env.cluster.kubectl("delete", "pod", "-n", env.operator_namespace, "-l", "app.kubernetes.io/name=kubelora-operator",
                        "--wait=false")

    # A new source is a new revision, loaded in place; status shows it per pod.
    step("new revision")
    old = adapter(env, "a2")["status"]
    env.cluster.kubectl("patch", "loraadapter", "a2", "-n", env.namespace, "--type=merge",
                        "-p", '{"spec": {"source": {"path": "/adapters/a2v2"}}}')

    def new_revision() -> dict | None:
        status = adapter(env, "a2")["status"]
        replicas = status.get("replicas") or []
        done = (status["revision"] != old["revision"] and status["phase"] == "Ready" and replicas
                and all(r["revision"] == status["revision"] for r in replicas))
        return status if done else None

    status = wait_for("a2's new revision", new_revision, timeout_s=90)
    assert status["replicas"][0]["contentRevision"] != old["replicas"][0]["contentRevision"]
    for pod_ip in pods.values():
        assert served_adapters(pod_ip)["a2"]["source"] == "/adapters/a2v2"
        assert complete(pod_ip, "a2") == offline["a2v2"]
    # The failed adapter was not retried (not even by the restarted operator): the others stayed Ready.
    step("failed adapter")
    assert adapter(env, "big")["status"]["phase"] == "Failed"
    events = env.cluster.get_json("events", "-n", env.namespace, "--field-selector",
                                  "involvedObject.name=big,reason=LoadFailed")["items"]
    assert len(events) == 1 and events[0].get("count", 1) == 1
    assert adapter(env, "a1")["status"]["phase"] == "Ready"

    # The router (the other half of the data plane) routes by the published placement.
    step("router")
    env.cluster.kubectl("patch", "lorapool", "pool1", "-n", env.namespace, "--type=merge",
                        "-p", '{"spec": {"router": {"enabled": true}}}')
    routers = wait_for("a ready router pod", lambda: ready_engine_pods(env, ROUTER_SELECTOR), timeout_s=90)
    router_ip = next(iter(routers.values()))
    step("router ready")
    assert complete(router_ip, "a1", port=8080) == offline["a1"]
    assert complete(router_ip, "a2", port=8080) == offline["a2v2"]
    assert complete(router_ip, "tiny", port=8080) == offline["tiny"]
    # With a router, the serving port admits the pool's routers (and the named namespace), no longer the
    # whole namespace; the admin token Secret was not remade by the update.
    assert engine_network_policy(env)["ingress"][1]["from"] == [
        {"podSelector": {"matchLabels": {"kubelora.io/pool": "pool1", "app.kubernetes.io/component": "router"}}},
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    assert pool_admin_token(env) == token
    env.cluster.kubectl("patch", "lorapool", "pool1", "-n", env.namespace, "--type=merge",
                        "-p", '{"spec": {"router": {"enabled": false}}}')
    wait_for("the router removed", lambda: not env.cluster.kubectl(
        "get", "deployments,roles,rolebindings,serviceaccounts", "-n", env.namespace, "-l",
        "app.kubernetes.io/component=router", "-o", "name").stdout.split(), timeout_s=60)

    # Deletion unloads from every pod.
    step("adapter deleted")
    env.cluster.kubectl("delete", "loraadapter", "a2", "-n", env.namespace, "--timeout=60s", timeout_s=70)
    wait_for("a2 unloaded everywhere", lambda: all("a2" not in served_adapters(i) for i in pods.values()),
             timeout_s=60)
    assert all("a1" in served_adapters(i) for i in pods.values())

    # Scale-in: the remaining pod keeps serving, status follows.
    step("scale in")
    env.cluster.kubectl("scale", "lorapool/pool1", "--replicas=1", "-n", env.namespace)

    def scaled_in() -> bool:
        status = adapter(env, "a1")["status"]
        return (len(ready_engine_pods(env)) == 1 and status["phase"] == "Ready" and status["desiredReplicas"] == 1
                and len(status["replicas"]) == 1)

    wait_for("a1 on the one remaining replica", scaled_in, timeout_s=90)

    # Fixing the pool retries what the engine refused under the old spec: a raised maxLoraRank rolls the
    # engine pod and "big" (rank 16) loads; the bad checksum is refused again and stays Failed.
    step("pool fixed")
    badsha_spec = adapter(env, "badsha")["status"]["failedPoolSpec"]
    env.cluster.kubectl("patch", "lorapool", "pool1", "-n", env.namespace, "--type=merge",
                        "-p", '{"spec": {"engine": {"maxLoraRank": 16}}}')

    def big_ready() -> bool:
        ready = ready_engine_pods(env)
        return (len(ready) == 1 and adapter(env, "big")["status"]["phase"] == "Ready"
                and "big" in served_adapters(next(iter(ready.values()))))

    wait_for("big loaded under the fixed pool", big_ready, timeout_s=150)
    (pod, ip), = ready_engine_pods(env).items()
    assert complete(ip, "big") != offline["tiny"]
    assert complete(ip, "a1") == offline["a1"]

    def refused_again() -> bool:
        status = adapter(env, "badsha").get("status") or {}
        return status.get("phase") == "Failed" and status.get("failedPoolSpec") not in (None, badsha_spec)

    wait_for("badsha refused again under the new pool spec", refused_again, timeout_s=60)

    # Deleting the pool garbage-collects what it owns; its adapters turn Pending and delete without hanging.
    step("pool deleted")
    env.cluster.kubectl("delete", "lorapool", "pool1", "-n", env.namespace, "--timeout=60s", timeout_s=70)

    def collected() -> bool:
        left = env.cluster.kubectl("get", "deployments,services,configmaps,pods", "-n", env.namespace,
                                   "-l", "kubelora.io/pool=pool1", "-o", "name").stdout.split()
        return not left

    wait_for("the pool's objects garbage-collected", collected, timeout_s=90)
    wait_for("a1 Pending without its pool", lambda: adapter(env, "a1")["status"]["phase"] == "Pending",
             timeout_s=30)
    conditions = {c["type"]: c["reason"] for c in adapter(env, "a1")["status"]["conditions"]}
    assert conditions["Ready"] == "PoolNotFound"
    env.cluster.kubectl("delete", "loraadapter", "--all", "-n", env.namespace, "--timeout=30s", timeout_s=40)
    step("done")
