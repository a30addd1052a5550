"""Client input gets a 4xx, never a 500: each hostile case against a real server (aiohttp test
client over the tiny model), and the server keeps serving afterwards."""

from __future__ import annotations

import asyncio
import json
import shutil
import struct
from pathlib import Path

import pytest

from kubelora.engine.server import json_body

COMPLETION = {"model": "a0", "prompt": "Hello", "max_tokens": 4}
CHAT = {"model": "a0", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}


@pytest.fixture
async def api(start_app, config_for, material):
    client = await start_app(config_for())
    response = await client.admin.post("/v1/load_lora_adapter", json={"lora_name": "a0",
                                                                "lora_path": str(material.adapters["a0"])})
    assert response.status == 200
    return client


async def _still_serves(api) -> None:
    response = await api.post("/v1/completions", json=COMPLETION)
    assert response.status == 200 and (await response.json())["usage"]["completion_tokens"] == 4


def _raw(body: dict) -> bytes:
    """Python's json writes NaN/Infinity bare, as a hostile client would."""
    return json.dumps(body).encode()


@pytest.mark.parametrize("field, value", [("temperature", "NaN"), ("temperature", "Infinity"),
                                          ("temperature", "-Infinity"), ("top_p", "NaN"), ("top_p", "Infinity")])
@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
async def test_nan_and_infinity_are_400(api, api_error, path, body, field, value):
    raw = json.dumps(body)[:-1] + f', "{field}": {value}}}'
    error = await api_error(await api.post(path, data=raw), 400, "invalid_request_error", code="invalid_json")
    assert value.lstrip("-") in error["message"]
    await _still_serves(api)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {**COMPLETION, "prompt": "a\ud800b"}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": ["fine", "a\udfffb"]}, "prompt[1]"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "a\ud800b"}]}, "messages[0].content"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages[0].content[0].text"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x", "name": "\udc00"}]},
     "messages[0].name"),
])
async def test_lone_surrogates_are_400(api, api_error, path, body, param):
    raw = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as a \ud800 escape
    assert b"\\ud" in raw or b"\\udc" in raw or b"\\udf" in raw
    await api_error(await api.post(path, data=raw), 400, "invalid_request_error", param, "invalid_value")
    await _still_serves(api)


@pytest.mark.parametrize("depth", [1000, 100_000])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/load_lora_adapter"])
async def test_deep_nesting_is_400(api, api_error, path, depth):
    """Too deep is refused; past the body's count of arrays and objects it is refused before any parse."""
    raw = '{"model": "a0", "prompt": ' + "[" * depth + "]" * depth + "}"
    port = api.admin if "lora_adapter" in path else api
    is_too_many = depth > json_body.MAX_JSON_CONTAINERS
    error = await api_error(await port.post(path, data=raw), 400, "invalid_request_error",
                            code="out_of_range" if is_too_many else "invalid_json")
    assert ("arrays and objects" if is_too_many else "nested too deeply") in error["message"]
    await _still_serves(api)


async def _raw_request(client, path: str, headers: bytes, body: bytes) -> tuple[int, dict]:
    """One HTTP/1.1 request written byte for byte (no client library would send these headers)."""
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    writer.write(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + headers
                 + b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
    await writer.drain()
    response = await reader.read()
    writer.close()
    head, _, payload = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


@pytest.mark.parametrize("admin_token", [None, "s3cret"])
@pytest.mark.parametrize("path, body", [("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"}),
                                        ("/v1/unload_lora_adapter", {"lora_name": "x"}),
                                        ("/v1/completions", {"model": "model", "prompt": "Hi", "max_tokens": 1})])
async def test_non_utf8_authorization_is_not_500(start_app, config_for, admin_token, path, body):
    client = await start_app(config_for(admin_token=admin_token))
    port = client if path == "/v1/completions" else client.admin
    for header in (b"Authorization: Bearer \xff\xfe\x80\r\n", b"Authorization: \xc3\x28 \xa0\xa1\r\n"):
        status, answer = await _raw_request(port, path, header, json.dumps(body).encode())
        assert status < 500, answer
        if admin_token is not None and path != "/v1/completions":
            assert status == 401 and answer["error"]["type"] == "authentication_error"


def _write_safetensors(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _header_of(path: Path) -> tuple[dict, bytes]:
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n]), blob[8 + n:]


A_KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
CRAFTED = {
    "offsets-scalar": lambda e: {**e, "data_offsets": 0},
    "offsets-three": lambda e: {**e, "data_offsets": [0, 1024, 2048]},
    "offsets-strings": lambda e: {**e, "data_offsets": ["0", "1024"]},
    "offsets-negative": lambda e: {**e, "data_offsets": [-1024, 0]},
    "offsets-bool": lambda e: {**e, "data_offsets": [False, True]},
    "dtype-list": lambda e: {**e, "dtype": ["F32"]},
    "dtype-object": lambda e: {**e, "dtype": {"F32": 1}},
    "shape-int": lambda e: {**e, "shape": 4},
    "shape-strings": lambda e: {**e, "shape": ["4", "64"]},
    "shape-negative": lambda e: {**e, "shape": [-4, -64]},
    "shape-float": lambda e: {**e, "shape": [4.0, 64.0]},
    "shape-huge": lambda e: {**e, "shape": [2**62, 2**62]},
    "entry-list": lambda e: [e],
    "entry-missing-dtype": lambda e: {k: v for k, v in e.items() if k != "dtype"},
}


@pytest.mark.parametrize("preload", [True, False])
@pytest.mark.parametrize("case", sorted(CRAFTED))
async def test_crafted_safetensors_headers_are_400(api, api_error, material, tmp_path, case, preload):
    adapter = material.adapter_root / "crafted" / f"{case}-{preload}"
    shutil.rmtree(adapter, ignore_errors=True)
    shutil.copytree(material.adapters["a0"], adapter)
    weights = adapter / "adapter_model.safetensors"
    header, data = _header_of(weights)
    header[A_KEY] = CRAFTED[case](header[A_KEY])
    _write_safetensors(weights, header, data)
    response = await api.admin.post("/v1/load_lora_adapter", json={"lora_name": "crafted", "lora_path": str(adapter),
                                                             "preload": preload})
    await api_error(response, 400, "adapter_load_error", "lora_path", "adapter_corrupt")
    models = await (await api.get("/v1/models")).json()
    assert "crafted" not in [m["id"] for m in models["data"]]
    await _still_serves(api)


async def test_more_prompts_than_the_queue_holds_is_400_not_429(start_app, config_for, api_error):
    client = await start_app(config_for(max_waiting=3))
    body = {"model": "model", "prompt": ["a", "b", "c", "d"], "max_tokens": 2}
    response = await client.post("/v1/completions", json=body)
    error = await api_error(response, 400, "invalid_request_error", "prompt", "out_of_range")
    assert "Retry-After" not in response.headers and "3" in error["message"]
    ok = await client.post("/v1/completions", json={**body, "prompt": ["a", "b", "c"]})
    assert ok.status == 200 and len((await ok.json())["choices"]) == 3


@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
async def test_integral_floats_for_integer_fields(api, api_error, path, body):
    integral = {"n": 1.0, "max_tokens": 4.0, "seed": 7.0, "top_k": 5.0}
    if path == "/v1/completions":
        integral |= {"best_of": 1.0, "logprobs": 0.0}
    else:
        integral |= {"max_completion_tokens": 4.0, "top_logprobs": 0.0}
    response = await api.post(path, json={**body, **integral})
    answer = await response.json()
    assert response.status == 200, answer
    assert answer["usage"]["completion_tokens"] == 4
    for field in integral:
        bad = {**body, field: 1.5}
        await api_error(await api.post(path, json=bad), 400, "invalid_request_error", field)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_an_integer_of_5000_digits_is_400(api, api_error, path):
    body = COMPLETION if path == "/v1/completions" else CHAT
    raw = json.dumps(body)[:-1] + ', "seed": 1' + "0" * 5000 + "}"
    await api_error(await api.post(path, data=raw), 400, "invalid_request_error", code="invalid_json")
    big = json.dumps(body)[:-1] + ', "seed": 1' + "0" * 5000 + ', "pad": "' + "x" * (300 << 10) + '"}'
    await api_error(await api.post(path, data=big), 400, "invalid_request_error", code="invalid_json")  # off the loop
    await _still_serves(api)
