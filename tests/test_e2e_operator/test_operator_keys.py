"""Tenant API keys end to end on a real API server: two tenants' key Secrets and adapters applied with kubectl,
calls through the router (by pod IP) and straight to the engine with the openai SDK:

- each key calls its own adapters; the other tenant's adapter is 403, no key 401; `/v1/models` per key;
- the engine refuses the same way behind the router (the last line);
- a revoked key (Secret deleted) is refused within 5 s; a stream it started before finishes;
- a rotated key (a new Secret) works within 5 s and the old one stops;
- a key's requestsPerMinute answers 429 with Retry-After;
- a refused key Secret (a weak key) gets a Warning event and shows in the pool status; refusals reach the
  adapter as a RequestsRefused event;
- no key appears in the router's or the engine's log, in the placement ConfigMap, or in any status.
"""
from __future__ import annotations

import json
import secrets
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from pytest_cluster import wait_for

from .conftest import adapter_manifest, pool_manifest
from .test_operator_lifecycle import ready_engine_pods

KEY_SECRET = """
apiVersion: v1
kind: Secret
metadata:
  name: {name}
  labels: {{kubelora.io/api-key-for: kpool}}
stringData:
  key: "{key}"
  adapters: "{adapters}"
  requestsPerMinute: "{rpm}"
"""
ENGINES = "kubelora.io/pool=kpool,app.kubernetes.io/component=engine"
ROUTERS = "kubelora.io/pool=kpool,app.kubernetes.io/component=router"
KEY_A, KEY_B, KEY_A2 = secrets.token_hex(32), secrets.token_urlsafe(32), secrets.token_hex(32)
FAST_S = 5.0  # revocation and rotation take effect within this


def client(ip: str, port: int, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{ip}:{port}/v1", api_key=key, timeout=60, max_retries=0)


def outcome(ip: str, port: int, key: str, model: str) -> int:
    """The HTTP status of one completion (200 when it answered)."""
    try:
        client(ip, port, key).completions.create(model=model, prompt="hello", max_tokens=2, temperature=0)
        return 200
    except openai.APIStatusError as exc:
        return exc.status_code


def unkeyed(ip: str, port: int, path: str) -> int:
    """The HTTP status of a request with no Authorization header (the openai SDK always sends one)."""
    data = json.dumps({"model": "a-chat", "prompt": "hello", "max_tokens": 2}).encode() if path != "/v1/models" \
        else None
    request = urllib.request.Request(f"http://{ip}:{port}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def seconds_until(check, timeout_s: float = 30.0) -> float:
    started = time.monotonic()
    wait_for("the key change to take effect", check, timeout_s=timeout_s, interval_s=0.1)
    return time.monotonic() - started


def test_two_tenants_with_their_keys(operator_env, material) -> None:
    try:
        _two_tenants(operator_env, material)
    except BaseException:
        for selector in (ENGINES, ROUTERS):  # what the pods said, for the failure's report
            print(operator_env.cluster.kubectl("logs", "-n", operator_env.namespace, "-l", selector, "--tail=40",
                                               check=False).stdout)
        raise


def _two_tenants(env, material) -> None:
    for name, key, adapters, rpm in (("tenant-a-key", KEY_A, "a-chat", 600), ("tenant-b-key", KEY_B, "b-chat", 3),
                                     ("weak-key", "abc", "a-chat", 600)):
        env.cluster.apply(KEY_SECRET.format(name=name, key=key, adapters=adapters, rpm=rpm), namespace=env.namespace)
    env.cluster.apply(pool_manifest("kpool", material, router=True, apiKeys={"required": True}),
                      namespace=env.namespace)
    for name, path in (("a-chat", "/adapters/a1"), ("b-chat", "/adapters/a2")):
        env.cluster.apply(adapter_manifest(name, "kpool", path), namespace=env.namespace)
    (_, engine_ip), = wait_for("a ready engine", lambda: ready_engine_pods(env, ENGINES), timeout_s=240).items()
    (_, router_ip), = wait_for("a ready router", lambda: ready_engine_pods(env, ROUTERS), timeout_s=120).items()
    for name in ("a-chat", "b-chat"):
        env.cluster.kubectl("wait", "--for=jsonpath={.status.phase}=Ready", f"loraadapter/{name}", "-n",
                            env.namespace, "--timeout=120s", timeout_s=130)

    # Each key calls its own adapters, through the router and at the engine alike.
    for ip, port in ((router_ip, 8080), (engine_ip, 8000)):
        assert outcome(ip, port, KEY_A, "a-chat") == 200
        assert outcome(ip, port, KEY_A, "b-chat") == 403
        assert outcome(ip, port, KEY_A, "no-such-adapter") == 403  # the same answer: existence is not told
        assert outcome(ip, port, KEY_A, "tiny") == 403  # the base model is not granted
        assert unkeyed(ip, port, "/v1/completions") == 401 and unkeyed(ip, port, "/v1/models") == 401
        assert outcome(ip, port, "not-a-key", "a-chat") == 401
        assert [m.id for m in client(ip, port, KEY_A).models.list()] == ["a-chat"]
        assert [m.id for m in client(ip, port, KEY_B).models.list()] == ["b-chat"]
        with pytest.raises(openai.AuthenticationError):
            client(ip, port, "wrong").models.list()

    # requestsPerMinute 3 for tenant b, per router replica: the fourth is 429 with Retry-After.
    statuses = [outcome(router_ip, 8080, KEY_B, "b-chat") for _ in range(3)]
    with pytest.raises(openai.RateLimitError) as refused:
        client(router_ip, 8080, KEY_B).completions.create(model="b-chat", prompt="hello", max_tokens=2)
    assert statuses == [200, 200, 200] and int(refused.value.response.headers["Retry-After"]) >= 1

    # The routers' refusals reach the adapters as events, by status, never a key (b-chat got KEY_A's 403s).
    wait_for("a RequestsRefused event on b-chat", lambda: [
        e for e in env.cluster.get_json("events", "-n", env.namespace, "--field-selector",
                                        "involvedObject.name=b-chat")["items"] if e["reason"] == "RequestsRefused"],
             timeout_s=30)

    # The weak key's Secret is refused, with a reason, and counted in the pool status.
    status = env.cluster.get_json("lorapool", "kpool", "-n", env.namespace)["status"]
    assert status["apiKeys"]["numKeys"] == 2
    assert [s["reason"] for s in status["apiKeys"]["refusedSecrets"]] == ["WeakKey"]
    events = env.cluster.get_json("events", "-n", env.namespace, "--field-selector",
                                  "involvedObject.name=weak-key")["items"]
    assert any(e["reason"] == "WeakKey" and e["type"] == "Warning" for e in events)

    # Revocation: a stream started before it finishes; new requests are 401 within FAST_S, at both.
    stream = client(router_ip, 8080, KEY_A).completions.create(model="a-chat", prompt="hello", max_tokens=64,
                                                                stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    chunks = []
    reader = threading.Thread(target=lambda: chunks.extend(stream))
    env.cluster.kubectl("delete", "secret", "tenant-a-key", "-n", env.namespace)
    revoked_s = took = seconds_until(lambda: outcome(router_ip, 8080, KEY_A, "a-chat") == 401)
    reader.start()
    reader.join(timeout=60)
    assert first.choices[0].text is not None and len(chunks) >= 1 and not reader.is_alive()
    assert took <= FAST_S, f"a revoked key still worked {took:.1f} s after its Secret was deleted"
    wait_for("the engine refuses the revoked key", lambda: outcome(engine_ip, 8000, KEY_A, "a-chat") == 401,
             timeout_s=FAST_S)

    # Rotation: tenant a's new key works within FAST_S; the old one stays refused.
    env.cluster.apply(KEY_SECRET.format(name="tenant-a-key-2", key=KEY_A2, adapters="a-chat", rpm=600),
                      namespace=env.namespace)
    took = seconds_until(lambda: outcome(router_ip, 8080, KEY_A2, "a-chat") == 200)
    assert took <= FAST_S, f"a new key took {took:.1f} s to work"
    print(f"[keys-e2e] a revoked key refused after {revoked_s:.2f} s, a new key served after {took:.2f} s", flush=True)
    wait_for("the engine takes the new key", lambda: outcome(engine_ip, 8000, KEY_A2, "a-chat") == 200,
             timeout_s=FAST_S)
    assert outcome(router_ip, 8080, KEY_A, "a-chat") == 401

    # No key in the logs, the placement ConfigMap or the pool's status.
    texts = [env.cluster.kubectl("logs", "-n", env.namespace, "-l", selector, "--tail=-1").stdout
             for selector in (ENGINES, ROUTERS)]
    texts.append(env.cluster.kubectl("get", "configmap", "kpool-placement", "-n", env.namespace, "-o",
                                     "yaml").stdout)
    texts.append(env.cluster.kubectl("get", "lorapool,loraadapters", "-n", env.namespace, "-o", "yaml").stdout)
    for key in (KEY_A, KEY_B, KEY_A2):
        assert not any(key in text for text in texts)
