"""Adapter loads are bounded: a download has one deadline for the whole adapter, an unload never
waits behind loads of other adapters, a load whose client left still ends with a log line, and oversized or
short adapter files are refused before they are read."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request

import pytest

DEADLINE_S = 1.5


def _load_body(name: str, path) -> dict:
    return {"lora_name": name, "lora_path": str(path)}


def _files_under(path) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(path) for f in files]


@pytest.mark.parametrize("path, deadline_s, failing_file", [
    ("trickle/0.5/a.tar.gz", DEADLINE_S, "a.tar.gz"),
    ("trickle-close/0.5/a.tar.gz", DEADLINE_S, "a.tar.gz"),
    ("slow-headers/0.5/a.tar.gz", DEADLINE_S, "a.tar.gz"),
    ("trickle/0.5/dir/", DEADLINE_S, "adapter_config.json"),
    # Each file takes ~1.3 s, within a deadline of 2 s; the two together do not.
    ("trickle/0.0012/dir/", 2.0, "adapter_model.safetensors"),
])
async def test_a_slow_source_fails_the_load_at_the_deadline(start_app, config_for, api_error, misbehaving_source,
                                                             tmp_path, caplog, path, deadline_s, failing_file):
    """One byte every 0.5 s (each read well within the per-read timeout), headers as slowly, or two files each
    under the deadline: the adapter's download has one deadline for all of it."""
    cache = tmp_path / "cache"
    client = await start_app(config_for(adapter_url_host=("127.0.0.1",), adapter_cache_dir=str(cache),
                                        adapter_download_timeout=deadline_s))
    started = time.monotonic()
    url = f"http://{misbehaving_source}/{path}"
    response = await client.admin.post("/v1/load_lora_adapter", json=_load_body("slow", url))
    error = await api_error(response, 400, "adapter_source_error", "lora_path", "download_failed")
    assert f"{failing_file}: it did not finish within the {deadline_s:g} s deadline" in error["message"]
    assert deadline_s - 0.1 < time.monotonic() - started < deadline_s + 2
    assert "adapter_load_failed" in caplog.text and _files_under(cache) == []
    models = await (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["model"]


def _post(url: str, body: dict, timeout: float) -> int:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _wait_for(predicate, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_load_whose_client_gave_up_still_ends_with_a_failure_log(live_server, misbehaving_source, caplog):
    server = live_server(adapter_url_host=("127.0.0.1",), adapter_download_timeout=DEADLINE_S)
    body = _load_body("abandoned", f"http://{misbehaving_source}/trickle/0.5/a.tar.gz")
    with pytest.raises((TimeoutError, urllib.error.URLError)):
        _post(server.admin_url + "/v1/load_lora_adapter", body, timeout=0.3)
    _wait_for(lambda: "adapter_load_failed" in caplog.text, DEADLINE_S + 3)
    [record] = [r for r in caplog.records if r.getMessage() == "adapter_load_failed"]
    fields = record.kubelora_fields
    assert fields["adapter"] == "abandoned" and "deadline" in fields["error"]


def test_unload_never_waits_behind_loads_of_other_adapters(live_server, material, misbehaving_source):
    server = live_server(adapter_url_host=("127.0.0.1",), adapter_download_timeout=3.0)
    server.load("a0", material.adapters["a0"])
    slow = [_load_body(f"slow{i}", f"http://{misbehaving_source}/trickle/0.5/{i}.tar.gz") for i in range(6)]
    statuses: dict[str, int] = {}
    threads = [threading.Thread(target=lambda b=b: statuses.__setitem__(b["lora_name"], server.admin_post(
        "/v1/load_lora_adapter", b)[0])) for b in slow]
    for thread in threads:
        thread.start()
    time.sleep(0.3)  # every admin thread is now downloading, two loads queue behind them
    started = time.monotonic()
    status, answer = server.admin_post("/v1/unload_lora_adapter", {"lora_name": "a0"})
    assert status == 200 and answer["was_loaded"] and time.monotonic() - started < 1.0
    # An unload of a name whose load is in flight waits for that load (it fails at its deadline) and no more.
    started = time.monotonic()
    status, answer = server.admin_post("/v1/unload_lora_adapter", {"lora_name": "slow0"})
    waited = time.monotonic() - started
    assert status == 200 and not answer["was_loaded"] and 2.0 < waited < 5.0
    # The load's own answer travels on another connection: it arrives about when the unload's does.
    threads[0].join(timeout=2.0)
    assert statuses.get("slow0") == 400
    for thread in threads:
        thread.join(timeout=30)
    assert statuses == {b["lora_name"]: 400 for b in slow}


async def test_a_download_shorter_than_its_content_length_is_refused_and_removed(
        start_app, config_for, api_error, misbehaving_source, tmp_path):
    cache = tmp_path / "cache"
    client = await start_app(config_for(adapter_url_host=("127.0.0.1",), adapter_cache_dir=str(cache)))
    for path in ("short/a.tar.gz", "short/dir/"):
        url = f"http://{misbehaving_source}/{path}"
        response = await client.admin.post("/v1/load_lora_adapter", json=_load_body("cut", url))
        error = await api_error(response, 400, "adapter_source_error", "lora_path", "download_failed")
        assert "ended after 10 of the 1000 bytes" in error["message"]
        assert _files_under(cache) == [] and sorted(os.listdir(cache)) == [".staging"]


@pytest.mark.parametrize("preload", [True, False])
async def test_local_adapter_with_a_gigabyte_of_trailing_bytes_is_refused_fast(start_app, config_for, api_error,
                                                                               material, preload):
    import shutil

    path = material.adapter_root / f"trailing-{preload}"
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(material.adapters["a1"], path)
    weights = path / "adapter_model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size + (1 << 30))  # sparse: no gigabyte on disk
    client = await start_app(config_for())
    started = time.monotonic()
    response = await client.admin.post("/v1/load_lora_adapter", json={**_load_body("trailing", path), "preload": preload})
    error = await api_error(response, 400, "adapter_load_error", "lora_path", "adapter_corrupt")
    assert f"{1 << 30} trailing bytes" in error["message"] and time.monotonic() - started < 1.0
    models = await (await client.get("/v1/models")).json()
    assert "trailing" not in [m["id"] for m in models["data"]]
