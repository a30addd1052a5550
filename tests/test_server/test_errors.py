"""Every bad input gets its 4xx in OpenAI's error shape, and the server keeps serving (aiohttp test client)."""

from __future__ import annotations

import asyncio
import os
import shutil

import pytest

from kubelora.engine.server.app import LIFECYCLE, build_app, build_engine


@pytest.fixture
async def api(start_app, config_for, material):
    client = await start_app(config_for(adapter_url_host=("models.example.com",)))
    response = await client.admin.post("/v1/load_lora_adapter", json={"lora_name": "a0",
                                                                "lora_path": str(material.adapters["a0"])})
    assert response.status == 200
    return client


COMPLETION = {"model": "a0", "prompt": "Hello", "max_tokens": 4}

BAD_COMPLETIONS = [
    (b"{not json", 400, "invalid_request_error", None, "invalid_json"),
    (b"[1, 2]", 400, "invalid_request_error", None, "invalid_json"),
    ({**COMPLETION, "max_tokens": "4"}, 400, "invalid_request_error", "max_tokens", "invalid_type"),
    ({**COMPLETION, "temperature": "hot"}, 400, "invalid_request_error", "temperature", "invalid_type"),
    ({**COMPLETION, "stream": 1}, 400, "invalid_request_error", "stream", "invalid_type"),
    ({**COMPLETION, "best_of_n": 3}, 400, "invalid_request_error", "best_of_n", "unknown_field"),
    ({**COMPLETION, "max_tokens": 10**9}, 400, "invalid_request_error", "max_tokens", "context_length_exceeded"),
    ({**COMPLETION, "prompt": [5] * 600}, 413, "prompt_too_long", "prompt", "context_length_exceeded"),
    ({**COMPLETION, "prompt": ""}, 400, "invalid_request_error", "prompt", "invalid_value"),
    ({**COMPLETION, "prompt": [10**6]}, 400, "invalid_request_error", "prompt", "invalid_request"),
    ({**COMPLETION, "model": "nobody"}, 404, "not_found_error", "model", "model_not_found"),
]


@pytest.mark.parametrize("body, status, type_, param, code", BAD_COMPLETIONS)
async def test_bad_completion_requests(api, body, status, type_, param, code, api_error):
    kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
    await api_error(await api.post("/v1/completions", **kwargs), status, type_, param, code)
    ok = await api.post("/v1/completions", json=COMPLETION)
    assert ok.status == 200 and (await ok.json())["usage"]["completion_tokens"] == 4


async def test_bad_chat_requests(api, api_error):
    await api_error(await api.post("/v1/chat/completions", json={"model": "a0", "messages": []}), 400,
                 "invalid_request_error", "messages")
    await api_error(await api.post("/v1/chat/completions", json={"model": "a0", "messages": [{"role": "user"}]}), 400,
                 "invalid_request_error", "messages[0].content", "missing_field")
    big = {"model": "a0", "messages": [{"role": "user", "content": "word " * 600}]}
    await api_error(await api.post("/v1/chat/completions", json=big), 413, "prompt_too_long", "messages")


def _load(name: str, path) -> dict:
    return {"lora_name": name, "lora_path": str(path)}


async def test_bad_adapter_loads(api, material, api_error):
    root = material.adapter_root
    if not (root / "escape").exists():
        os.symlink(material.model_dir, root / "escape")
    cases = [
        (_load("x", f"{root}/../model"), 400, "adapter_source_error", "lora_path", "path_not_allowed"),
        (_load("x", material.model_dir), 400, "adapter_source_error", "lora_path", "path_not_allowed"),
        (_load("x", root / "escape"), 400, "adapter_source_error", "lora_path", "path_not_allowed"),
        (_load("x", root / "missing"), 400, "adapter_source_error", "lora_path", "path_not_found"),
        (_load("x", "https://evil.example.net/a.tar.gz"), 400, "adapter_source_error", "lora_path", "url_not_allowed"),
        (_load("x", material.extra["corrupt"]), 400, "adapter_load_error", "lora_path", "adapter_corrupt"),
        (_load("x", material.extra["wrong-base"]), 400, "adapter_load_error", "lora_path", "adapter_shape_mismatch"),
        (_load("x", material.extra["rank32"]), 400, "adapter_load_error", "lora_path", "adapter_rank_too_large"),
        (_load("model", material.adapters["a1"]), 400, "invalid_request_error", "lora_name", "invalid_value"),
        (_load("../x", material.adapters["a1"]), 400, "invalid_request_error", "lora_name", "invalid_value"),
        ({"lora_name": "x"}, 400, "invalid_request_error", "lora_path", "missing_field"),
        ({**_load("x", material.adapters["a1"]), "auth_token": ""}, 400, "invalid_request_error", "auth_token",
         "invalid_value"),
        (_load("a0", material.adapters["a1"]), 409, "conflict_error", "lora_name", "adapter_exists"),
    ]
    for body, status, type_, param, code in cases:
        await api_error(await api.admin.post("/v1/load_lora_adapter", json=body), status, type_, param, code)
    models = await (await api.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["model", "a0"]  # nothing half-registered
    assert (await api.post("/v1/completions", json=COMPLETION)).status == 200


async def test_unknown_routes_and_methods(api, api_error):
    await api_error(await api.get("/v1/nothing"), 404, "not_found_error")
    await api_error(await api.get("/v1/completions"), 405, "invalid_request_error")
    response = await api.admin.post("/v1/unload_lora_adapter", json={"lora_name": "never-loaded"})
    assert response.status == 200 and not (await response.json())["was_loaded"]


async def test_failed_on_demand_load_fails_only_its_requests(api, material, api_error):
    path = material.root / "adapters" / "ondemand"
    shutil.copytree(material.adapters["a5"], path, dirs_exist_ok=True)
    response = await api.admin.post("/v1/load_lora_adapter", json={**_load("ondemand", path), "preload": False})
    assert (await response.json())["adapter"]["residency"] == "known"
    (path / "adapter_model.safetensors").write_bytes(b"garbage now")
    await api_error(await api.post("/v1/completions", json={**COMPLETION, "model": "ondemand"}), 503,
                 "adapter_unavailable", "model")
    stream = await api.post("/v1/completions", json={**COMPLETION, "model": "ondemand", "stream": True})
    text = await stream.text()
    assert stream.status == 200 and '"type":"adapter_unavailable"' in text and text.endswith("data: [DONE]\n\n")
    assert (await api.post("/v1/completions", json=COMPLETION)).status == 200
    models = await (await api.get("/v1/models")).json()
    [card] = [m for m in models["data"] if m["id"] == "ondemand"]
    assert card["last_error"] and card["residency"] == "known"


async def test_queue_full_gives_429_with_retry_after(start_app, config_for, slow_engine_factory, api_error):
    # One running, one waiting, the rest refused: 64 steps of >= 5 ms keep the first one running meanwhile.
    config = config_for(max_num_seqs=1, max_waiting=1)
    client = await start_app(config, slow_engine_factory(0.005))
    body = {"model": "model", "prompt": "Hello", "max_tokens": 64, "ignore_eos": True}
    responses = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(6)))
    statuses = sorted(r.status for r in responses)
    assert 200 in statuses and 429 in statuses, statuses
    for response in responses:
        if response.status == 429:
            assert int(response.headers["Retry-After"]) >= 1
            await api_error(response, 429, "rate_limit_error", code="queue_full")
    assert (await client.post("/v1/completions", json=body)).status == 200


async def test_not_ready_gives_503_and_health_is_up(aiohttp_client, config_for, api_error):
    release = asyncio.Event()
    loop = asyncio.get_running_loop()

    def slow_factory(config):
        asyncio.run_coroutine_threadsafe(release.wait(), loop).result()
        return build_engine(config)

    app = build_app(config_for(), slow_factory)
    client = await aiohttp_client(app)
    assert (await client.get("/health")).status == 200
    assert (await client.get("/ready")).status == 503
    await api_error(await client.post("/v1/completions", json=COMPLETION), 503, "service_unavailable",
                 code="engine_not_ready")
    release.set()
    await asyncio.wait_for(app[LIFECYCLE].done.wait(), 60)
    assert (await client.get("/ready")).status == 200


class _BrokenEngine:
    """Proxies a real engine; add_request raises a bug (not an engine error) for one prompt token, and step()
    raises once `is_step_broken` is set."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.is_step_broken = False

    def step(self):
        if self.is_step_broken:
            raise RuntimeError("bug inside the engine step")
        return self._engine.step()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def add_request(self, request_id, prompt_token_ids, *args, **kwargs):
        if prompt_token_ids == [7]:
            raise RuntimeError("secret internal detail")
        return self._engine.add_request(request_id, prompt_token_ids, *args, **kwargs)


async def test_bug_gives_500_without_details(start_app, config_for, api_error):
    client = await start_app(config_for(), lambda c: _BrokenEngine(build_engine(c)))
    error = await api_error(await client.post("/v1/completions", json={"model": "model", "prompt": [7]}), 500,
                         "server_error")
    assert "secret" not in error["message"]
    assert (await client.post("/v1/completions", json={"model": "model", "prompt": [8], "max_tokens": 2})).status == 200


@pytest.fixture
def served_archive(material, tmp_path):
    """a4 as a .tar.gz on a loopback HTTP server: (url, sha256)."""
    import hashlib
    import http.server
    import tarfile
    import threading

    archive = tmp_path / "www" / "a4.tar.gz"
    archive.parent.mkdir()
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(material.adapters["a4"], arcname="a4")
    handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(*a, directory=str(archive.parent), **k)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/a4.tar.gz", hashlib.sha256(archive.read_bytes()).hexdigest()
    server.shutdown()
    server.server_close()


async def test_load_from_url(start_app, config_for, material, served_archive, tmp_path, api_error):
    url, digest = served_archive
    client = await start_app(config_for(adapter_url_host=("127.0.0.1",), adapter_cache_dir=str(tmp_path / "cache")))
    await api_error(await client.admin.post("/v1/load_lora_adapter", json={**_load("web", url), "sha256": "0" * 64}), 400,
                 "adapter_source_error", "sha256", "sha256_mismatch")
    response = await client.admin.post("/v1/load_lora_adapter", json={**_load("web", url), "sha256": digest})
    card = (await response.json())["adapter"]
    assert response.status == 200 and card["source"] == card["root"] == url  # no admin token: no local path
    assert client.app[LIFECYCLE].serving.adapters.get("web").path.startswith(str(tmp_path / "cache"))
    assert card["sha256"] == digest  # echoed, so the operator can tell a changed digest apart after a restart
    again = await client.admin.post("/v1/load_lora_adapter", json=_load("web", url))
    assert (await again.json())["was_loaded"]  # same bytes, same cache directory, same revision
    ok = await client.post("/v1/completions", json={**COMPLETION, "model": "web"})
    assert ok.status == 200


async def test_engine_step_bug_fails_open_requests_and_health(start_app, config_for, api_error):
    engines = []
    client = await start_app(config_for(), lambda c: engines.append(_BrokenEngine(build_engine(c)))
                          or engines[-1])
    assert (await client.get("/health")).status == 200
    engines[0].is_step_broken = True
    body = {"model": "model", "prompt": [8], "max_tokens": 2}
    await api_error(await client.post("/v1/completions", json=body), 503, "service_unavailable", code="engine_stopped")
    assert (await client.get("/health")).status == 503 and (await client.get("/ready")).status == 503
    await api_error(await client.post("/v1/completions", json=body), 503, "service_unavailable",
                 code="engine_not_ready")
