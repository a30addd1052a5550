"""Adapter load errors say whether the same load may succeed later (`retryable`): the operator retries only those.

Transient: a missing path, missing adapter files, a download's network failure, HTTP 404/429/5xx, a cut body.
Permanent: a refused path or host, corrupt files, a rank or shape mismatch, the size limit, HTTP 401/403.
"""

from __future__ import annotations

import http.server
import threading
from pathlib import Path

import pytest

from kubelora.contract.errors import AdapterSourceError
from kubelora.contract.http_errors import to_http
from kubelora.engine.server.sources import SourceConfig, resolve_source

from ..live_http import free_port


class _StatusHandler(http.server.BaseHTTPRequestHandler):
    """`/status/<code>/...` answers that HTTP status; `/big/...` a body larger than the test's limit."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's hook
        parts = self.path.strip("/").split("/")
        if parts[0] == "status":
            self.send_error(int(parts[1]))
            return
        body = b"x" * 5000
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the stdlib's signature
        pass


@pytest.fixture
def status_host():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _StatusHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()



def _error(config: SourceConfig, source: str) -> dict:
    with pytest.raises(AdapterSourceError) as info:
        resolve_source(config, source)
    answer = to_http(info.value)
    assert answer.status == 400
    return answer.body()["error"]


@pytest.mark.parametrize("status, is_retryable", [(404, True), (429, True), (500, True), (503, True),
                                                  (401, False), (403, False), (410, False)])
def test_download_status_decides(tmp_path: Path, status_host: str, status: int, is_retryable: bool):
    config = SourceConfig(allowed_hosts=(status_host,), cache_dir=tmp_path / "cache")
    error = _error(config, f"http://{status_host}/status/{status}/a.tar.gz")
    assert (error["code"], error["retryable"]) == ("download_failed", is_retryable)
    assert f"HTTP {status}" in error["message"]


def test_connection_refused_is_retryable_and_size_limit_is_not(tmp_path: Path, status_host: str):
    host = f"127.0.0.1:{free_port()}"
    config = SourceConfig(allowed_hosts=(host,), cache_dir=tmp_path / "cache")
    assert _error(config, f"http://{host}/a.tar.gz")["retryable"] is True
    small = SourceConfig(allowed_hosts=(status_host,), cache_dir=tmp_path / "cache2", max_bytes=1000)
    error = _error(small, f"http://{status_host}/big/a.tar")
    assert (error["code"], error["retryable"]) == ("download_failed", False)


def test_local_refusals(tmp_path: Path, status_host: str):
    root = tmp_path / "root"
    root.mkdir()
    config = SourceConfig(roots=(root,), allowed_hosts=(status_host,), cache_dir=tmp_path / "cache")
    missing = _error(config, str(root / "not-yet"))
    assert (missing["code"], missing["retryable"]) == ("path_not_found", True)
    (root / "adapter_model.safetensors").write_bytes(b"weights")  # a file instead of the adapter's directory
    a_file = _error(config, str(root / "adapter_model.safetensors"))
    assert (a_file["code"], a_file["retryable"]) == ("path_not_directory", False)
    outside = _error(config, str(tmp_path))
    assert (outside["code"], outside["retryable"]) == ("path_not_allowed", False)
    refused_host = _error(config, "http://elsewhere.example.com/a.tar.gz")
    assert (refused_host["code"], refused_host["retryable"]) == ("url_not_allowed", False)


def _load(name: str, path) -> dict:
    return {"lora_name": name, "lora_path": str(path)}


async def test_admin_api_bodies(start_app, config_for, material, tmp_path: Path):
    """Through the server: missing files are retryable; corrupt files, rank and shape are not; other errors
    (not adapter loads) carry no `retryable`."""
    api = await start_app(config_for())
    empty = material.adapter_root / "empty-for-retryable"
    empty.mkdir(exist_ok=True)  # a directory whose files are not copied yet
    cases = [
        (_load("x", material.adapter_root / "missing"), "path_not_found", True),
        (_load("x", empty), "adapter_not_found", True),
        (_load("x", material.extra["corrupt"]), "adapter_corrupt", False),
        (_load("x", material.extra["rank32"]), "adapter_rank_too_large", False),
        (_load("x", material.extra["wrong-base"]), "adapter_shape_mismatch", False),
        (_load("x", material.model_dir), "path_not_allowed", False),
    ]
    for body, code, is_retryable in cases:
        response = await api.admin.post("/v1/load_lora_adapter", json=body)
        error = (await response.json())["error"]
        assert response.status == 400 and (error["code"], error.get("retryable")) == (code, is_retryable), error
    response = await api.admin.post("/v1/load_lora_adapter", json={"lora_name": "x"})
    assert response.status == 400 and "retryable" not in (await response.json())["error"]
