"""s3:// adapter sources against a real S3 server: MinIO built from the Go module proxy (e2e/s3), on loopback.

A prefix holding the adapter files and an archive object load and serve as the same adapter loaded from a
path does; wrong credentials are a permanent error, a key not there yet a transient one; the bucket and
endpoint policy refuses the rest; no credential reaches an error, a log line or /v1/models.
"""

from __future__ import annotations

import io
import logging
import sys
import tarfile
import time
from pathlib import Path

import pytest

from kubelora.contract.errors import AdapterSourceError
from kubelora.contract.logs import JsonFormatter
from kubelora.contract.http_errors import to_http
from kubelora.engine.server.protocol import InvalidRequest, parse_load_adapter
from kubelora.engine.server.s3 import S3Access
from kubelora.engine.server.source_text import redact_source
from kubelora.engine.server.sources import SourceConfig, resolve_source

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e" / "s3"))
from s3server import MinioServer, build_minio  # noqa: E402

BUCKET = "adapters"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@pytest.fixture(scope="module")
def minio(tmp_path_factory, material, shown):
    """MinIO with bucket `adapters`: team/a0/ (the adapter files of a0) and team/a0.tar.gz (the same)."""
    with shown():  # minutes on a fresh machine: say so
        build_minio()
    with MinioServer(tmp_path_factory.mktemp("minio") / "data") as server:
        server.make_bucket(BUCKET)
        archive = io.BytesIO()
        with tarfile.open(fileobj=archive, mode="w:gz") as tar:
            for name in ADAPTER_FILES:
                tar.add(material.adapters["a0"] / name, arcname=f"a0/{name}")
        for name in ADAPTER_FILES:
            server.put(BUCKET, f"team/a0/{name}", (material.adapters["a0"] / name).read_bytes())
        server.put(BUCKET, "team/a0.tar.gz", archive.getvalue())
        yield server


def keys(server: MinioServer, **overrides) -> S3Access:
    fields = {"endpoint": server.endpoint, "access_key_id": server.access_key_id,
              "secret_access_key": server.secret_access_key, **overrides}
    return S3Access(**fields)


def config(tmp_path: Path, server: MinioServer, **overrides) -> SourceConfig:
    return SourceConfig(**{"allowed_s3_buckets": (BUCKET,), "allowed_s3_endpoints": (server.endpoint,),
                           "cache_dir": tmp_path / "cache", **overrides})


def refused(cfg: SourceConfig, source: str, access: S3Access) -> dict:
    with pytest.raises(AdapterSourceError) as info:
        resolve_source(cfg, source, s3=access)
    answer = to_http(info.value)
    assert answer.status == 400
    return answer.body()["error"]


def test_a_prefix_and_an_archive_give_the_adapter_files(tmp_path, minio, material):
    cfg = config(tmp_path, minio)
    for source in (f"s3://{BUCKET}/team/a0/", f"s3://{BUCKET}/team/a0", f"s3://{BUCKET}/team/a0.tar.gz"):
        directory = resolve_source(cfg, source, s3=keys(minio)).path
        for name in ADAPTER_FILES:
            assert (directory / name).read_bytes() == (material.adapters["a0"] / name).read_bytes(), source
    assert not any((cfg.cache_dir / ".staging").iterdir())  # nothing left half-written
    # sha256 of the archive (or of the weights of a prefix) is checked as for URLs.
    with pytest.raises(AdapterSourceError, match="sha256"):
        resolve_source(cfg, f"s3://{BUCKET}/team/a0/", "0" * 64, s3=keys(minio))


def test_wrong_credentials_are_permanent_and_never_shown(tmp_path, minio, caplog):
    caplog.set_level(logging.DEBUG)
    cfg = config(tmp_path, minio)
    wrong_secret = "not-the-secret-but-secret-looking"
    for access in (keys(minio, secret_access_key=wrong_secret), keys(minio, access_key_id="NOSUCHKEY")):
        error = refused(cfg, f"s3://{BUCKET}/team/a0.tar.gz", access)
        assert (error["code"], error["retryable"]) == ("download_failed", False), error
        assert "HTTP 403" in error["message"] and f"s3://{BUCKET}/team/a0.tar.gz" in error["message"]
        for secret in (wrong_secret, minio.secret_access_key, "X-Amz-Signature", "X-Amz-Credential"):
            assert secret not in error["message"] and secret not in caplog.text
    assert "SignatureDoesNotMatch" in refused(cfg, f"s3://{BUCKET}/team/a0/", keys(minio, secret_access_key="x" * 12))[
        "message"]


def test_a_missing_key_is_transient_a_refused_bucket_or_endpoint_permanent(tmp_path, minio):
    cfg = config(tmp_path, minio)
    missing = refused(cfg, f"s3://{BUCKET}/team/not-yet.tar.gz", keys(minio))
    assert (missing["code"], missing["retryable"]) == ("download_failed", True) and "NoSuchKey" in missing["message"]
    half = refused(cfg, f"s3://{BUCKET}/team/", keys(minio))  # a prefix without the adapter files (yet)
    assert half["retryable"] is True and "team/adapter_config.json" in half["message"]
    other_bucket = refused(cfg, "s3://elsewhere/team/a0.tar.gz", keys(minio))
    assert (other_bucket["code"], other_bucket["retryable"]) == ("url_not_allowed", False)
    other_endpoint = refused(cfg, f"s3://{BUCKET}/team/a0.tar.gz", keys(minio, endpoint="http://127.0.0.2:9"))
    assert (other_endpoint["code"], other_endpoint["retryable"]) == ("url_not_allowed", False)
    no_buckets = refused(config(tmp_path, minio, allowed_s3_buckets=()), f"s3://{BUCKET}/team/a0/", keys(minio))
    assert no_buckets["code"] == "url_not_allowed" and "--adapter-s3-bucket" in no_buckets["message"]
    for bad in (f"s3://ak:sk@{BUCKET}/x", f"s3://{BUCKET}/x?versionId=1", "s3://Bad_Bucket/x",
                f"s3://{BUCKET}/a/../b"):
        assert refused(cfg, bad, keys(minio))["retryable"] is False, bad


def test_the_download_limits_hold_for_s3(tmp_path, minio):
    small = refused(config(tmp_path, minio, max_bytes=100), f"s3://{BUCKET}/team/a0.tar.gz", keys(minio))
    assert (small["code"], small["retryable"]) == ("download_failed", False) and "limit" in small["message"]
    closed = S3Access(endpoint="http://127.0.0.1:9", access_key_id="a", secret_access_key="b")
    unreachable = refused(config(tmp_path, minio, allowed_s3_endpoints=("http://127.0.0.1:9",)),
                          f"s3://{BUCKET}/team/a0.tar.gz", closed)
    assert unreachable["retryable"] is True  # connection refused: the server may come up


def test_the_load_request_s3_field_is_checked():
    body = {"lora_name": "a", "lora_path": f"s3://{BUCKET}/x", "s3": {"endpoint": "http://m:9000",
                                                                    "access_key_id": "AK", "secret_access_key": "SK"}}
    request = parse_load_adapter(body)
    assert request.s3 == S3Access("http://m:9000", None, "AK", "SK") and "SK" not in repr(request)
    for s3, param in (({"access_key_id": "AK"}, "s3"), ({"endpoint": "ftp://m"}, "s3"),
                      ({"region": "Not A Region"}, "s3"), ({"token": "x"}, "s3.token"),
                      ({"access_key_id": ""}, "s3.access_key_id")):
        with pytest.raises(InvalidRequest) as info:
            parse_load_adapter({**body, "s3": s3})
        assert info.value.param == param, s3
    with pytest.raises(AdapterSourceError, match="s3:// sources only"):
        resolve_source(SourceConfig(), "https://h/a", s3=S3Access())
    assert redact_source(f"s3://AK:SK@{BUCKET}/team/a0/") == f"s3://<redacted>@{BUCKET}/team/a0/"


def test_a_live_server_serves_an_s3_adapter_and_shows_no_credentials(live_server, material, minio, caplog):
    caplog.set_level(logging.DEBUG)
    server = live_server(adapter_s3_bucket=(BUCKET,), adapter_s3_endpoint=(minio.endpoint,))
    s3 = {"endpoint": minio.endpoint, "access_key_id": minio.access_key_id,
          "secret_access_key": minio.secret_access_key}
    server.load("from-prefix", f"s3://{BUCKET}/team/a0/", s3=s3)
    server.load("from-archive", f"s3://{BUCKET}/team/a0.tar.gz", s3=s3)
    server.load("from-path", material.adapters["a0"])
    client = server.client()
    texts = {name: client.completions.create(model=name, prompt="the adapter says", max_tokens=6,
                                             temperature=0).choices[0].text
             for name in ("from-prefix", "from-archive", "from-path")}
    assert texts["from-prefix"] == texts["from-archive"] == texts["from-path"], texts
    status, models = server.get("/v1/models")
    assert status == 200 and f"s3://{BUCKET}/team/a0/".encode() in models
    status, wrong = server.admin_post("/v1/load_lora_adapter", {"lora_name": "wrong", "lora_path":
                                      f"s3://{BUCKET}/team/a0.tar.gz", "s3": {**s3, "secret_access_key": "W" * 20}})
    assert status == 400 and wrong["error"]["retryable"] is False
    status, missing = server.admin_post("/v1/load_lora_adapter", {"lora_name": "missing", "lora_path":
                                        f"s3://{BUCKET}/team/late.tar.gz", "s3": s3})
    assert status == 400 and missing["error"]["retryable"] is True
    # The log lines as the server writes them (JSON, with every field), once both failures are logged.
    deadline = time.monotonic() + 10
    while logged(caplog).count('"adapter_load_failed"') < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = logged(caplog)
    assert f"s3://{BUCKET}/team/late.tar.gz" in lines and f"s3://{BUCKET}/team/a0/" in lines
    for secret in (minio.secret_access_key.encode(), b"W" * 20, b"X-Amz-Signature"):
        assert secret not in models and secret.decode() not in lines
        assert secret.decode() not in str(wrong) + str(missing)


def logged(caplog) -> str:
    return "\n".join(JsonFormatter().format(record) for record in caplog.records)


def test_without_keys_the_default_credential_chain_signs(tmp_path, minio, monkeypatch):
    """No key pair in the request (no Secret named): the chain's first link, the environment, as on a pod whose
    env the deployer set (a web identity token is the next link, which needs STS)."""
    cfg = config(tmp_path, minio)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", minio.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    assert refused(cfg, f"s3://{BUCKET}/team/a0.tar.gz", S3Access(endpoint=minio.endpoint))["retryable"] is False
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", minio.secret_access_key)
    directory = resolve_source(cfg, f"s3://{BUCKET}/team/a0.tar.gz", s3=S3Access(endpoint=minio.endpoint)).path
    assert (directory / "adapter_config.json").is_file()
