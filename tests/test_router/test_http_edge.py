"""The router's HTTP edge against hostile tenants, as the engine's: a compressed body is 415 before any byte of it
is inflated (or forwarded), and a malformed header is refused without being repeated to the client or the log,
while the router keeps answering."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import zlib

import aiohttp
import pytest

from kubelora.router import cli
from kubelora.router.config import RouterConfig

from ..live_http import MALFORMED_HEADERS, SECRET, gzip_bomb, raw_exchange, split_answer
from .conftest import placement_text

BODY = json.dumps({"model": "base", "prompt": "Hi", "max_tokens": 1}).encode()


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "GZIP, identity"])
async def test_compressed_bodies_are_415_before_inflating(engines, router, encoding):
    client = await router(placement_text(engines))
    bomb = gzip_bomb(1 << 30)  # 1 GiB of zeros: inflating it would cost the loop seconds
    started = time.monotonic()
    response = await client.post("/v1/completions", data=bomb,
                                 headers={"Content-Type": "application/json", "Content-Encoding": encoding})
    answer = await response.json()
    assert response.status == 415 and answer["error"]["code"] == "unsupported_content_encoding", answer
    assert time.monotonic() - started < 2
    response = await client.post("/v1/completions", data=zlib.compress(BODY), headers={"Content-Encoding": encoding})
    assert response.status == 415
    assert all(not e.seen for e in engines)  # nothing was forwarded
    response = await client.post("/v1/completions", data=BODY, headers={"Content-Encoding": "identity"})
    assert response.status == 200 and (await response.json())["choices"][0]["text"].startswith("from p")


@pytest.fixture
async def served_router(engines, tmp_path):
    """The router as `kubelora router` runs it (its runner, a placement file), on a free loopback port: its URL."""
    placement = tmp_path / "placement.json"
    placement.write_text(placement_text(engines))
    config = RouterConfig(pool="p", placement_file=str(placement), host="127.0.0.1", port=0)
    stop, bound = asyncio.Event(), asyncio.get_running_loop().create_future()
    task = asyncio.create_task(cli.serve(config, stop, on_listening=bound.set_result))
    addresses = await asyncio.wait_for(bound, 30)
    yield f"http://127.0.0.1:{addresses[0][1]}"
    stop.set()
    assert await asyncio.wait_for(task, 30) == 0


@pytest.mark.parametrize("case", sorted(MALFORMED_HEADERS))
async def test_malformed_headers_are_400_and_never_repeated(engines, served_router, caplog, case):
    """Neither the answer nor the log holds the refused header's bytes; the router keeps answering."""
    caplog.set_level(logging.DEBUG)
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               + MALFORMED_HEADERS[case] + f"Content-Length: {len(BODY)}\r\n\r\n".encode() + BODY)
    port = int(served_router.rsplit(":", 1)[1])
    answer = await asyncio.to_thread(raw_exchange, port, request)  # the router runs on this loop
    assert SECRET.encode() not in answer, answer[:300]
    status, headers, payload = split_answer(answer)
    assert status == 400 and headers["content-type"].startswith("application/json"), answer[:300]
    error = json.loads(payload)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "malformed_request", error
    await asyncio.sleep(0.2)  # aiohttp logs after answering
    formatter = logging.Formatter()
    logged = "\n".join(formatter.format(record) for record in caplog.records)
    assert SECRET not in logged
    assert [r for r in caplog.records if "not logged" in r.getMessage()], logged[-2000:]
    assert all(not e.seen for e in engines)  # the malformed request was not forwarded
    async with aiohttp.ClientSession(served_router) as session:
        async with session.get("/health") as response:
            assert response.status == 200
        async with session.post("/v1/completions", data=BODY) as response:
            assert response.status == 200 and (await response.json())["choices"][0]["text"].startswith("from p")
