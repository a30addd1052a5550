"""The HTTP edge against hostile tenants: compressed bodies are refused before inflating, malformed headers never
reach the log, and a body's shape (depth, arrays and objects, strings) is bounded however it is decoded."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
import zlib

import pytest

from kubelora.contract.errors import InvalidRequest
from kubelora.engine.server import json_body
from kubelora.engine.server.json_body import MAX_JSON_CONTAINERS, MAX_JSON_DEPTH, MAX_JSON_STRINGS, decode_json_object

SECRET = "sk-tenant-7f3a9c2e51d04b8a"


def _gzip_bomb(inflated_bytes: int) -> bytes:
    """gzip of `inflated_bytes` zeros (about 1 KiB of output per MiB), built without holding them in memory."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    chunk = bytes(1 << 20)
    parts = [compressor.compress(chunk) for _ in range(inflated_bytes >> 20)]
    return b"".join(parts) + compressor.flush()


def _post(url: str, body: bytes, headers: dict) -> tuple[int, dict, float]:
    started = time.monotonic()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **headers},
                                     method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, payload = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, payload = exc.code, exc.read()
    return status, json.loads(payload), time.monotonic() - started


class HealthPoller:
    """`/health` polled every 20 ms on a thread while the block runs; `worst_s` is the slowest answer."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._stop = threading.Event()
        self.latencies: list[float] = []

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            with urllib.request.urlopen(self._url + "/health", timeout=30) as response:
                assert response.status == 200
            self.latencies.append(time.monotonic() - started)
            time.sleep(0.02)

    def __enter__(self) -> HealthPoller:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(0.1)
        self._stop.set()
        self._thread.join(timeout=60)

    @property
    def worst_s(self) -> float:
        assert len(self.latencies) >= 2, self.latencies
        return max(self.latencies)


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "GZIP, identity"])
def test_compressed_bodies_are_415_before_inflating(live_server, encoding):
    server = live_server()
    bomb = _gzip_bomb(1 << 30)  # 1 GiB of zeros: inflating it on the loop took seconds
    assert len(bomb) < 2 << 20
    with HealthPoller(server.url) as poller:
        status, answer, seconds = _post(server.url + "/v1/completions", bomb, {"Content-Encoding": encoding})
    assert status == 415, answer
    assert answer["error"]["code"] == "unsupported_content_encoding" and seconds < 2
    assert poller.worst_s < 1.0, poller.latencies
    body = json.dumps({"model": server.serving.model_name, "prompt": "Hello", "max_tokens": 2}).encode()
    status, answer, _ = _post(server.url + "/v1/completions", zlib.compress(body), {"Content-Encoding": encoding})
    assert status == 415, answer
    status, answer, _ = _post(server.url + "/v1/completions", body, {"Content-Encoding": "identity"})
    assert status == 200 and answer["usage"]["completion_tokens"] == 2, answer


def test_compressed_bodies_are_415_on_the_admin_port(live_server):
    server = live_server(admin_token="admin-secret")
    body = zlib.compress(json.dumps({"lora_name": "x", "lora_path": "/nowhere"}).encode())
    headers = {"Content-Encoding": "deflate", "Authorization": "Bearer admin-secret"}
    status, answer, _ = _post(server.admin_url + "/v1/load_lora_adapter", body, headers)
    assert status == 415 and answer["error"]["code"] == "unsupported_content_encoding", answer


def _raw_exchange(port: int, request: bytes) -> bytes:
    """The answer's bytes; b"" when the server reset the connection first (it closes after a parser error, and
    unread request bytes make the close a reset that may overtake its answer)."""
    chunks = []
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        try:
            sock.sendall(request)
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except ConnectionError:
            pass
    return b"".join(chunks)


MALFORMED_HEADERS = {
    "control character": f"Authorization: Bearer {SECRET}\x01tail\r\n".encode(),
    "NUL": f"Authorization: Bearer {SECRET}\x00\r\n".encode(),
    "over 8 KiB": f"Authorization: Bearer {SECRET}{'x' * 9000}\r\n".encode(),
    "other header": f"X-Api-Key: {SECRET}\x7f\x02\r\n".encode(),
    "bare LF in value": f"Authorization: Bearer {SECRET}\nX: y\r\n".encode(),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_HEADERS))
def test_malformed_headers_never_reach_the_log(live_server, caplog, case):
    server = live_server(admin_token=SECRET)
    caplog.set_level(logging.DEBUG)
    body = json.dumps({"model": server.serving.model_name, "prompt": "Hi", "max_tokens": 1}).encode()
    for url, path in ((server.url, "/v1/completions"), (server.admin_url, "/v1/load_lora_adapter")):
        port = int(url.rsplit(":", 1)[1])
        request = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
                   + MALFORMED_HEADERS[case] + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        answer = _raw_exchange(port, request)
        assert answer == b"" or answer.split(b" ", 2)[1].startswith(b"4"), (path, answer[:200])
    time.sleep(0.2)  # aiohttp logs after answering
    formatter = logging.Formatter()
    logged = "\n".join(formatter.format(record) for record in caplog.records)
    assert SECRET not in logged
    redacted = [record for record in caplog.records if "not logged" in record.getMessage()]
    assert len(redacted) == 2, logged[-2000:]  # one per port
    ok = server.client().completions.create(model=server.serving.model_name, prompt="Hello", max_tokens=2)
    assert ok.usage.completion_tokens == 2


def _nested(depth: int) -> bytes:
    """A body whose deepest array is at `depth` (the body itself is level 1)."""
    return b'{"a": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


def _padded(raw: bytes) -> bytes:
    """`raw` with enough brackets in a string that a large body goes through the Python scanner."""
    return raw[:-1] + b', "pad": "' + b"[" * (json_body.MAX_HOOKLESS_CONTAINERS + 1) + b'"}'


DECODERS = {
    "inline": lambda raw: decode_json_object(raw),
    "large, C decoder": lambda raw: decode_json_object(raw, is_large=True),
    "large, Python scanner": lambda raw: decode_json_object(_padded(raw), is_large=True),
}


@pytest.mark.parametrize("decoder", sorted(DECODERS))
def test_body_shape_limits_hold_on_every_decoder(decoder):
    decode = DECODERS[decoder]
    assert decode(_nested(MAX_JSON_DEPTH))["a"] is not None
    with pytest.raises(InvalidRequest, match="nested too deeply") as caught:
        decode(_nested(MAX_JSON_DEPTH + 1))
    assert caught.value.code == "invalid_json"
    many = MAX_JSON_CONTAINERS - 2  # the body and its array are containers too
    assert len(decode(b'{"a": [' + b",".join([b"[]"] * many) + b"]}")["a"]) == many
    for body in (b'{"a": [' + b",".join([b"{}"] * (many + 1)) + b"]}",
                 b'{"a": [' + b",".join([b'""'] * (MAX_JSON_STRINGS + 1)) + b"]}"):
        with pytest.raises(InvalidRequest, match="more than") as caught:
            decode(body)
        assert caught.value.code == "out_of_range"


@pytest.mark.parametrize("decoder", sorted(DECODERS))
@pytest.mark.parametrize("raw, param", [
    (b'{"tools": [{"function": {"parameters": {"x": "\\ud800"}}}]}', "tools[0].function.parameters.x"),
    (b'{"chat_template_kwargs": {"k": ["ok", "\\udfff"]}}', "chat_template_kwargs.k[1]"),
    (b'{"a": {"\\ud800": 1}}', "a"),
    (b'{"a": "\xed\xa0\x80"}', "a"),  # a surrogate written as (invalid) UTF-8 bytes, which json reads
])
def test_lone_surrogates_are_400_naming_their_path(decoder, raw, param):
    with pytest.raises(InvalidRequest, match="surrogate") as caught:
        DECODERS[decoder](raw)
    assert caught.value.param == param and caught.value.code == "invalid_value"


def test_python_scanner_refuses_empty_arrays_fast():
    """15 MiB of empty arrays held the GIL for 1.6 s in the C decoder; the scanner stops at the limit."""
    raw = b'{"a": [' + b"[]," * (5 << 20) + b"[]]}"
    started = time.monotonic()
    with pytest.raises(InvalidRequest, match="more than"):
        decode_json_object(raw, is_large=True)
    assert time.monotonic() - started < 1.0
