"""No secrets in open endpoints: the serving port's `GET /v1/models` redacts the query string of an
adapter's source and shows no local path, token or not; the admin port shows both to the admin token;
`source_digest` identifies the full source for every caller. Adapter names with path segments such as `..` are
refused."""

from __future__ import annotations

import hashlib
import http.server
import tarfile
import threading

import pytest

SECRET = "X-Amz-Signature=d3adb33f&X-Amz-Credential=AKIAEXAMPLE"


@pytest.fixture
def presigned_url(material, tmp_path):
    """a4 as a .tar.gz on a loopback HTTP server, behind a URL whose query string is a credential."""
    www = tmp_path / "www"
    www.mkdir()
    with tarfile.open(www / "a4.tar.gz", "w:gz") as tar:
        tar.add(material.adapters["a4"], arcname="a4")
    handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(*a, directory=str(www), **k)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/a4.tar.gz?{SECRET}"
    server.shutdown()
    server.server_close()


def _digest(source: str) -> str:
    return "sha256:" + hashlib.sha256(source.encode()).hexdigest()


async def _cards(client, token: str | None = None) -> tuple[dict[str, dict], str]:
    """The cards of GET /v1/models by id, and the body's text."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = await client.get("/v1/models", headers=headers)
    text = await response.text()
    assert response.status == 200
    return {card["id"]: card for card in (await response.json())["data"]}, text


@pytest.mark.parametrize("admin_token", [None, "s3cret"])
async def test_models_without_the_token_redact_sources(start_app, config_for, material, presigned_url, tmp_path,
                                                       caplog, admin_token):
    cache = tmp_path / "cache"
    client = await start_app(config_for(adapter_url_host=("127.0.0.1",), adapter_cache_dir=str(cache),
                                        admin_token=admin_token))
    auth = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
    for name, source in (("web", presigned_url), ("local", "a1")):  # "a1": relative to the adapter root
        response = await client.admin.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": source},
                                     headers=auth)
        answer = await response.text()
        assert response.status == 200, answer
        assert (SECRET in answer) == (admin_token is not None and name == "web")  # the load answer holds a card
    base_url = presigned_url.split("?")[0]
    cards, text = await _cards(client)
    for leak in (SECRET, "d3adb33f", str(cache), str(material.adapter_root)):
        assert leak not in text
    assert cards["web"]["source"] == cards["web"]["root"] == base_url + "?<redacted>"
    assert cards["local"]["source"] == cards["local"]["root"] == "a1"
    assert cards["web"]["source_digest"] == _digest(presigned_url) and cards["local"]["source_digest"] == _digest("a1")
    if admin_token:
        full, _ = await _cards(client.admin, admin_token)
        assert full["web"]["source"] == presigned_url and full["web"]["root"].startswith(str(cache))
        assert full["local"]["source"] == "a1" and full["local"]["root"] == str(material.adapters["a1"].resolve())
        assert full["web"]["source_digest"] == cards["web"]["source_digest"]
        assert (await client.admin.get("/v1/models", headers={"Authorization": "Bearer wrong"})).status == 401
        public, _ = await _cards(client, admin_token)  # the serving port redacts even for the admin token
        assert public["web"]["source"] == base_url + "?<redacted>"
    else:
        open_admin, _ = await _cards(client.admin)  # no token configured: the admin port redacts too
        assert open_admin["web"]["source"] == base_url + "?<redacted>"
    one = await (await client.get("/v1/models/web")).json()
    assert one["source"] == base_url + "?<redacted>"
    assert SECRET not in caplog.text and "d3adb33f" not in caplog.text  # nor in the logs


async def test_operator_plan_matches_a_redacted_card(start_app, config_for, presigned_url, tmp_path):
    """The operator compares what it wants with what a pod reports, token or not."""
    from kubelora.operator.plan import DesiredAdapter, ObservedAdapter, is_current

    client = await start_app(config_for(adapter_url_host=("127.0.0.1",), adapter_cache_dir=str(tmp_path / "c")))
    response = await client.admin.post("/v1/load_lora_adapter", json={"lora_name": "web", "lora_path": presigned_url})
    assert response.status == 200
    cards, _ = await _cards(client)
    observed = ObservedAdapter.from_card(cards["web"])
    assert is_current(observed, DesiredAdapter("web", presigned_url, None, "r1"), None)
    assert not is_current(observed, DesiredAdapter("web", presigned_url + "x", None, "r1"), None)


@pytest.mark.parametrize("name", ["a/../../x", "a/..", "../a", "a/./b", "a//b", "a/", "./a", "a\n", "a/b/../c"])
async def test_adapter_names_with_path_segments_are_refused(start_app, config_for, api_error, material, name):
    client = await start_app(config_for())
    for path, body in (("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(material.adapters["a0"])}),
                       ("/v1/unload_lora_adapter", {"lora_name": name})):
        error = await api_error(await client.admin.post(path, json=body), 400, "invalid_request_error", "lora_name",
                                "invalid_value")
        assert "'..'" in error["message"]
    ok = await client.admin.post("/v1/load_lora_adapter", json={"lora_name": "org/team.v1:2@x",
                                                          "lora_path": str(material.adapters["a0"])})
    assert ok.status == 200
    cards, _ = await _cards(client)
    assert sorted(cards) == ["model", "org/team.v1:2@x"]


def test_lora_flag_names_with_path_segments_are_refused(config_for, material):
    with pytest.raises(ValueError, match="lora name 'a/../x'"):
        config_for(lora=(("a/../x", str(material.adapters["a0"])),))
