"""Two real engines (`kubelora engine serve`) behind a real router (`kubelora router --placement-file`), all three
as processes on loopback, driven by the openai SDK: routing by placement, streaming, a placement change under
traffic.

The operator's contract is mimicked: every pool adapter is registered on both engines with preload false, so a
replica that does not hold an adapter yet loads it on its first request.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from kubelora.router.hashring import HashRing

from ..live_http import free_port

KUBELORA = str(Path(sys.executable).with_name("kubelora"))
COMMON = dict(max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
PROMPT = "The operator watches the cluster"



def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def _wait_ready(url: str, procs: list[subprocess.Popen], timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while _get(url + "/ready")[0] != 200:
        assert all(p.poll() is None for p in procs), "a process exited early; see its log"
        assert time.monotonic() < deadline, f"{url} not ready"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """{"engines": {pod: url}, "router": url, "placement": path, "adapters": names} with everything running."""
    from kubelora.cli.tiny import make_adapter, make_tiny_model

    root = tmp_path_factory.mktemp("router-live")
    model = make_tiny_model(root / "model", seed=0)
    adapters = {f"a{i}": make_adapter(root / "adapters" / f"a{i}", model, rank=4 * (i + 1), seed=20 + i)
                for i in range(3)}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONSAFEPATH": "1"}
    procs, logs = [], []
    engines, admin_urls = {}, {}
    for pod in ("engine-0", "engine-1"):
        port, admin_port = free_port(), free_port()
        log = open(root / f"{pod}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen([KUBELORA, "engine", "serve", "--model", str(model), "--max-loras", "2",
                                       "--max-lora-rank", "16", "--max-cpu-loras", "4", "--max-model-len", "128",
                                       "--host", "127.0.0.1", "--port", str(port), "--admin-port", str(admin_port),
                                       "--adapter-root", str(root / "adapters")],
                                      stdout=log, stderr=subprocess.STDOUT, env=env))
        engines[pod] = f"http://127.0.0.1:{port}"
        admin_urls[pod] = f"http://127.0.0.1:{admin_port}"
    placement = root / "placement.json"
    write_placement(placement, engines, {"a0": ["engine-0"], "a1": []}, revision=1)
    router_port = free_port()
    log = open(root / "router.log", "w")
    logs.append(log)
    procs.append(subprocess.Popen([KUBELORA, "router", "--placement-file", str(placement), "--host", "127.0.0.1",
                                   "--port", str(router_port), "--poll-interval", "0.1"],
                                  stdout=log, stderr=subprocess.STDOUT, env=env))
    try:
        for pod, url in engines.items():
            _wait_ready(url, procs)
            for name in ("a0", "a1"):
                _post(admin_urls[pod] + "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapters[name]),
                                                      "preload": False})
        router = f"http://127.0.0.1:{router_port}"
        _wait_ready(router, procs)
        yield {"engines": engines, "router": router, "placement": placement}
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        for log in logs:
            log.close()


def write_placement(path: Path, engines: dict[str, str], adapters: dict[str, list[str]], revision: int) -> None:
    doc = {"pool": "live", "baseModel": "model", "revision": revision, "adapters": adapters,
           "replicas": [{"pod": pod, "url": url, "ready": True} for pod, url in engines.items()]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)  # atomic, as a ConfigMap update is


def residency(engine_url: str) -> dict[str, str]:
    models = json.loads(_get(engine_url + "/v1/models")[1])["data"]
    return {m["id"]: m["residency"] for m in models if m.get("parent")}


async def _complete(client, model: str, stream: bool) -> tuple[str, str]:
    """(text, pod that answered) for one greedy completion."""
    raw = await client.completions.with_raw_response.create(model=model, prompt=PROMPT, stream=stream, **COMMON)
    pod = raw.headers.get("x-kubelora-replica", "")  # empty straight from an engine
    result = raw.parse()  # legacy raw response: parse() is synchronous
    if stream:
        return "".join([chunk.choices[0].text async for chunk in result]), pod
    return result.choices[0].text, pod


async def test_requests_follow_the_placement_and_match_the_engines(pool):
    engines, router = pool["engines"], pool["router"]
    direct = openai.AsyncOpenAI(base_url=engines["engine-1"] + "/v1", api_key="x", max_retries=0)
    client = openai.AsyncOpenAI(base_url=router + "/v1", api_key="x", max_retries=0, timeout=120)
    home_a1 = HashRing(list(engines)).walk("a1")[0]
    served = {}
    for model, expected_pod in (("model", None), ("a0", "engine-0"), ("a1", home_a1)):
        for stream in (False, True):
            served[model, stream] = text, pod = await _complete(client, model, stream)
            assert expected_pod is None or pod == expected_pod, (model, stream)
    chat = await client.chat.completions.create(model="a0", messages=[{"role": "user", "content": "hi"}], **COMMON)
    assert chat.choices[0].finish_reason == "length"
    with pytest.raises(openai.NotFoundError, match="a2"):
        await client.completions.create(model="a2", prompt=PROMPT, **COMMON)
    assert [m.id for m in (await client.models.list()).data] == ["model", "a0", "a1"]
    # Only the replica that served an adapter loaded it; the other keeps it registered (`known`).
    other = "engine-1" if home_a1 == "engine-0" else "engine-0"
    assert residency(engines["engine-1"])["a0"] == "known"
    assert residency(engines[other])["a1"] == "known" and residency(engines[home_a1])["a1"] != "known"
    for (model, stream), (text, _) in served.items():  # asked last: asking engine-1 loads the adapters there
        assert text == (await _complete(direct, model, stream=False))[0], (model, stream)
    await direct.close()
    await client.close()


async def test_placement_change_under_traffic_moves_the_adapter_without_errors(pool):
    engines, router = pool["engines"], pool["router"]
    client = openai.AsyncOpenAI(base_url=router + "/v1", api_key="x", max_retries=0, timeout=120)
    served: list[tuple[float, str]] = []  # (request start, pod that answered)
    stop = asyncio.Event()

    async def traffic(stream: bool) -> None:
        while not stop.is_set():
            started = time.monotonic()  # the router picks the replica when the request arrives
            text, pod = await _complete(client, "a0", stream)
            assert text
            served.append((started, pod))

    workers = [asyncio.create_task(traffic(stream)) for stream in (True, False, True)]
    await asyncio.sleep(1.0)
    write_placement(pool["placement"], engines, {"a0": ["engine-1"], "a1": []}, revision=2)
    changed_at = time.monotonic()
    deadline = changed_at + 60
    while not [pod for t, pod in served if t > changed_at + 2.5]:
        assert time.monotonic() < deadline, "no traffic after the placement change"
        await asyncio.sleep(0.1)
    stop.set()
    await asyncio.gather(*workers)  # any failed request fails here
    before = {pod for t, pod in served if t < changed_at}
    after = {pod for t, pod in served if t > changed_at + 2.0}  # the router polls every 0.1 s; margin for load
    assert before == {"engine-0"} and after == {"engine-1"}
    assert residency(engines["engine-1"])["a0"] != "known"  # engine-1 loaded it on demand
    metrics = _get(router + "/metrics")[1].decode()
    assert "kubelora_router_placement_revision 2.0" in metrics
    await client.close()
