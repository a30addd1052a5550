"""Adapter sources: local paths confined to the roots, URLs to allowed hosts, archives extracted safely."""

from __future__ import annotations

import hashlib
import http.server
import io
import os
import tarfile
import threading
import zipfile
from pathlib import Path

import pytest

from kubelora.contract.errors import AdapterSourceError
from kubelora.contract.http_errors import to_http
from kubelora.contract.sources import host_allowed
from kubelora.engine.server.sources import SourceConfig, confine_local, resolve_source

FILES = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"weights"}


def _adapter(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in FILES.items():
        (directory / name).write_bytes(data)
    return directory


def _refused(fn, *args, code: str | None = None, **kwargs) -> AdapterSourceError:
    with pytest.raises(AdapterSourceError) as info:
        fn(*args, **kwargs)
    assert to_http(info.value).status == 400
    if code:
        assert info.value.code == code
    return info.value


def test_local_inside_root(tmp_path):
    root = tmp_path / "root"
    adapter = _adapter(root / "team" / "a")
    assert confine_local((root,), str(adapter)) == adapter.resolve()
    assert confine_local((root,), "team/a") == adapter.resolve()
    assert confine_local((root,), f"file://{adapter}") == adapter.resolve()


def test_local_refusals(tmp_path):
    root = tmp_path / "root"
    _adapter(root / "a")
    outside = _adapter(tmp_path / "outside")
    error = _refused(confine_local, (root,), str(outside), code="path_not_allowed")
    assert "outside the adapter roots" in error.message and error.param == "lora_path"
    _refused(confine_local, (root,), f"{root}/a/../../outside", code="path_not_allowed")
    _refused(confine_local, (root,), "../outside", code="path_not_allowed")
    _refused(confine_local, (), str(root / "a"), code="path_not_allowed")
    _refused(confine_local, (root,), str(root / "missing"))
    os.symlink(outside, root / "link")
    _refused(confine_local, (root,), str(root / "link"), code="path_not_allowed")
    sneaky = _adapter(root / "sneaky")
    (sneaky / "adapter_model.safetensors").unlink()
    os.symlink(outside / "adapter_model.safetensors", sneaky / "adapter_model.safetensors")
    assert "link out of" in _refused(confine_local, (root,), str(sneaky)).message


def test_symlink_within_root_is_fine(tmp_path):
    root = tmp_path / "root"
    real = _adapter(root / "v1")
    os.symlink(real, root / "current")
    assert confine_local((root,), str(root / "current")) == real.resolve()


def test_local_sha256(tmp_path):
    root = tmp_path / "root"
    _adapter(root / "a")
    good = hashlib.sha256(FILES["adapter_model.safetensors"]).hexdigest()
    config = SourceConfig(roots=(root,))
    assert resolve_source(config, str(root / "a"), good).sha256 == good
    assert _refused(resolve_source, config, str(root / "a"), "0" * 64).code == "sha256_mismatch"


def test_host_allowed():
    hosts = ("models.example.com", "127.0.0.1:8080", "*.cdn.example.org")
    assert host_allowed(hosts, "https://models.example.com/a.tar.gz")
    assert host_allowed(hosts, "http://127.0.0.1:8080/x")
    assert not host_allowed(hosts, "http://127.0.0.1:9090/x")
    assert host_allowed(hosts, "https://eu.cdn.example.org/x")
    assert not host_allowed(hosts, "https://evil.com/models.example.com")
    assert not host_allowed(hosts, "ftp://models.example.com/x")
    assert not host_allowed((), "https://models.example.com/x")


def test_unsupported_scheme(tmp_path):
    _refused(resolve_source, SourceConfig(cache_dir=tmp_path), "gs://bucket/a", code="unsupported_scheme")
    # s3:// is a source of its own (tests/test_server/test_s3_sources.py), refused here by the bucket policy.
    _refused(resolve_source, SourceConfig(cache_dir=tmp_path), "s3://bucket/a", code="url_not_allowed")


TOKEN = "s3cret-token"


class _Handler(http.server.SimpleHTTPRequestHandler):
    seen_auth: list[tuple[str, str | None]] = []  # (path, Authorization header) of every request

    def do_GET(self):  # noqa: N802 - http.server's hook
        auth = self.headers.get("Authorization")
        _Handler.seen_auth.append((self.path, auth))
        if self.path.startswith("/redirect-out"):
            self.send_response(302)
            self.send_header("Location", "http://elsewhere.invalid/a.tar.gz")
            self.end_headers()
            return
        if self.path.startswith("/hop/"):  # to another allowed host: /hop/<host:port>/<path>
            _, _, target, rest = self.path.split("/", 3)
            self.send_response(302)
            self.send_header("Location", f"http://{target}/{rest}")
            self.end_headers()
            return
        if self.path.startswith("/private/") and auth != f"Bearer {TOKEN}":
            self.send_error(401, "a bearer token is required")
            return
        super().do_GET()

    def log_message(self, *args):
        pass


def _serve(served: Path):
    handler = lambda *a, **k: _Handler(*a, directory=str(served), **k)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def http_root(tmp_path):
    served = tmp_path / "served"
    served.mkdir()
    server = _serve(served)
    yield served, f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _tar_bytes(members: dict[str, bytes], links: dict[str, str] | None = None, mode: str = "w:gz") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            tar.addfile(info)
    return buf.getvalue()


def _zip_bytes(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


def _config(tmp_path, host, **kw) -> SourceConfig:
    return SourceConfig(allowed_hosts=(host,), cache_dir=tmp_path / "cache", **kw)


def test_download_archives(tmp_path, http_root):
    served, host = http_root
    tar = _tar_bytes({f"adapter/{k}": v for k, v in FILES.items()})
    (served / "a.tar.gz").write_bytes(tar)
    (served / "b.zip").write_bytes(_zip_bytes(FILES))
    config = _config(tmp_path, host)
    first = resolve_source(config, f"http://{host}/a.tar.gz", hashlib.sha256(tar).hexdigest())
    assert (first.path / "adapter_model.safetensors").read_bytes() == b"weights"
    assert first.path.is_relative_to(tmp_path / "cache")
    assert resolve_source(config, f"http://{host}/a.tar.gz").path == first.path  # same bytes, same directory
    assert (resolve_source(config, f"http://{host}/b.zip").path / "adapter_config.json").exists()
    _refused(resolve_source, config, f"http://{host}/a.tar.gz", "1" * 64, code="sha256_mismatch")


def test_download_directory_url(tmp_path, http_root):
    served, host = http_root
    _adapter(served / "dir")
    resolved = resolve_source(_config(tmp_path, host), f"http://{host}/dir/")
    assert (resolved.path / "adapter_config.json").read_bytes() == FILES["adapter_config.json"]
    _refused(resolve_source, _config(tmp_path, host), f"http://{host}/nothing/", code="download_failed")


@pytest.mark.parametrize("name, payload", [
    ("traversal.tar.gz", _tar_bytes({"../evil": b"x", **FILES})),
    ("absolute.tar.gz", _tar_bytes({"/tmp/evil": b"x", **FILES})),
    ("symlink.tar", _tar_bytes(FILES, links={"link": "/etc/passwd"}, mode="w")),
    ("traversal.zip", _zip_bytes({"../evil": b"x", **FILES})),
    ("garbage.tar.gz", b"not an archive"),
])
def test_unsafe_archives_refused(tmp_path, http_root, name, payload):
    served, host = http_root
    (served / name).write_bytes(payload)
    _refused(resolve_source, _config(tmp_path, host), f"http://{host}/{name}", code="unsafe_archive")
    assert not (tmp_path / "evil").exists()


def test_zip_symlink_refused(tmp_path, http_root):
    served, host = http_root
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        info = zipfile.ZipInfo("link")
        info.external_attr = (0o120777 << 16)
        zf.writestr(info, "/etc/passwd")
    (served / "link.zip").write_bytes(buf.getvalue())
    _refused(resolve_source, _config(tmp_path, host), f"http://{host}/link.zip", code="unsafe_archive")


def test_size_limit_and_hosts(tmp_path, http_root):
    served, host = http_root
    (served / "big.tar").write_bytes(_tar_bytes({"adapter_config.json": b"x" * 5000}, mode="w"))
    _refused(resolve_source, _config(tmp_path, host, max_bytes=1000), f"http://{host}/big.tar",
             code="download_failed")
    _refused(resolve_source, _config(tmp_path, "other:1"), f"http://{host}/big.tar", code="url_not_allowed")
    _refused(resolve_source, _config(tmp_path, host), f"http://{host}/redirect-out", code="url_not_allowed")
    _refused(resolve_source, _config(tmp_path, host), f"http://u:p@{host}/big.tar", code="url_not_allowed")


def test_bearer_token_for_the_source_host_only(tmp_path, http_root):
    served, host = http_root
    _adapter(served / "private" / "dir")
    config = _config(tmp_path, host)
    refused = _refused(resolve_source, config, f"http://{host}/private/dir/", code="download_failed")
    assert "HTTP 401" in str(refused) and TOKEN not in str(refused)
    resolved = resolve_source(config, f"http://{host}/private/dir/", auth_token=TOKEN)
    assert (resolved.path / "adapter_config.json").read_bytes() == FILES["adapter_config.json"]
    # A redirect to another (allowed) host does not carry the token there.
    other = _serve(served)
    other_host = f"127.0.0.1:{other.server_address[1]}"
    try:
        _Handler.seen_auth.clear()
        two_hosts = SourceConfig(allowed_hosts=(host, other_host), cache_dir=tmp_path / "cache2")
        _refused(resolve_source, two_hosts, f"http://{host}/hop/{other_host}/private/dir/", auth_token=TOKEN,
                 code="download_failed")
        assert ("/hop/" + other_host + "/private/dir/adapter_config.json", f"Bearer {TOKEN}") in _Handler.seen_auth
        assert ("/private/dir/adapter_config.json", None) in _Handler.seen_auth
    finally:
        other.shutdown()
        other.server_close()


@pytest.mark.parametrize("name", ["many.tar.gz", "many.zip"])
def test_archive_member_count_is_capped(tmp_path, http_root, name):
    """5000 empty members besides the adapter's files: refused after the first 1001 headers, nothing written."""
    import time

    from kubelora.engine.server.archives import MAX_MEMBERS

    members = {**FILES, **{f"junk/{i}": b"" for i in range(5000)}}
    served, host = http_root
    (served / name).write_bytes(_zip_bytes(members) if name.endswith(".zip") else _tar_bytes(members))
    config = _config(tmp_path, host)
    started = time.monotonic()
    error = _refused(resolve_source, config, f"http://{host}/{name}", code="unsafe_archive")
    assert f"more than {MAX_MEMBERS} members" in error.message and time.monotonic() - started < 2
    assert [f for _, _, files in os.walk(tmp_path / "cache") for f in files] == []
    (served / "few.tar.gz").write_bytes(_tar_bytes({**FILES, **{f"junk/{i}": b"" for i in range(MAX_MEMBERS - 2)}}))
    assert (resolve_source(config, f"http://{host}/few.tar.gz").path / "adapter_config.json").exists()
