"""The HTTP edge against hostile tenants: compressed bodies are refused before inflating, malformed headers are
refused without being repeated to the client or the log, and a body's shape (depth, arrays and objects, strings)
is bounded however it is decoded."""

from __future__ import annotations

import json
import logging
import time
import zlib

import pytest

from kubelora.contract.errors import InvalidRequest
from kubelora.engine.server import json_body
from kubelora.engine.server.json_body import MAX_JSON_CONTAINERS, MAX_JSON_DEPTH, MAX_JSON_STRINGS, decode_json_object

from ..live_http import MALFORMED_HEADERS, SECRET, HealthProbe, gzip_bomb, post_json, raw_exchange, split_answer


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "GZIP, identity"])
def test_compressed_bodies_are_415_before_inflating(live_server, encoding):
    server = live_server()
    bomb = gzip_bomb(1 << 30)  # 1 GiB of zeros: inflating it on the loop took seconds
    assert len(bomb) < 2 << 20
    with HealthProbe(server.url, interval_s=0.02, min_probes=2) as probe:
        status, answer, seconds = post_json(server.url + "/v1/completions", bomb, {"Content-Encoding": encoding})
    assert status == 415, answer
    assert answer["error"]["code"] == "unsupported_content_encoding" and seconds < 2
    assert probe.worst_s < 1.0, probe.latencies
    body = json.dumps({"model": server.serving.model_name, "prompt": "Hello", "max_tokens": 2}).encode()
    status, answer, _ = post_json(server.url + "/v1/completions", zlib.compress(body), {"Content-Encoding": encoding})
    assert status == 415, answer
    status, answer, _ = post_json(server.url + "/v1/completions", body, {"Content-Encoding": "identity"})
    assert status == 200 and answer["usage"]["completion_tokens"] == 2, answer


def test_compressed_bodies_are_415_on_the_admin_port(live_server):
    server = live_server(admin_token="admin-secret")
    body = zlib.compress(json.dumps({"lora_name": "x", "lora_path": "/nowhere"}).encode())
    headers = {"Content-Encoding": "deflate", "Authorization": "Bearer admin-secret"}
    status, answer, _ = post_json(server.admin_url + "/v1/load_lora_adapter", body, headers)
    assert status == 415 and answer["error"]["code"] == "unsupported_content_encoding", answer


@pytest.mark.parametrize("case", sorted(MALFORMED_HEADERS))
def test_malformed_headers_are_400_and_never_repeated(live_server, caplog, case):
    """Neither the answer nor the log holds the refused header's bytes, on the serving and the admin port."""
    server = live_server(admin_token=SECRET)
    caplog.set_level(logging.DEBUG)
    body = json.dumps({"model": server.serving.model_name, "prompt": "Hi", "max_tokens": 1}).encode()
    for url, path in ((server.url, "/v1/completions"), (server.admin_url, "/v1/load_lora_adapter")):
        port = int(url.rsplit(":", 1)[1])
        request = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
                   + MALFORMED_HEADERS[case] + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        answer = raw_exchange(port, request)
        assert SECRET.encode() not in answer, (path, answer[:300])
        status, headers, payload = split_answer(answer)
        assert status == 400 and headers["content-type"].startswith("application/json"), (path, answer[:300])
        error = json.loads(payload)["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "malformed_request", error
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
