"""The router's HTTP edge against hostile tenants, as the engine's: a compressed body is 415 before any byte of it
is inflated (or forwarded), and a malformed header never reaches the log, while the router keeps answering."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import zlib

import pytest

from .conftest import placement_text

SECRET = "sk-tenant-7f3a9c2e51d04b8a"
BODY = json.dumps({"model": "base", "prompt": "Hi", "max_tokens": 1}).encode()


def _gzip_bomb(inflated_bytes: int) -> bytes:
    """gzip of `inflated_bytes` zeros (about 1 KiB of output per MiB), built without holding them in memory."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    chunk = bytes(1 << 20)
    return b"".join(compressor.compress(chunk) for _ in range(inflated_bytes >> 20)) + compressor.flush()


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "GZIP, identity"])
async def test_compressed_bodies_are_415_before_inflating(engines, router, encoding):
    client = await router(placement_text(engines))
    bomb = _gzip_bomb(1 << 30)  # 1 GiB of zeros: inflating it would cost the loop seconds
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


async def _raw_exchange(port: int, request: bytes) -> bytes:
    """The answer's bytes; b"" when the router reset the connection first (it closes after a parser error, and
    unread request bytes make the close a reset that may overtake its answer)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 30)
    except ConnectionError:
        return b""
    finally:
        writer.close()


MALFORMED_HEADERS = {
    "control character": f"Authorization: Bearer {SECRET}\x01tail\r\n".encode(),
    "NUL": f"Authorization: Bearer {SECRET}\x00\r\n".encode(),
    "over 8 KiB": f"Authorization: Bearer {SECRET}{'x' * 9000}\r\n".encode(),
    "other header": f"X-Api-Key: {SECRET}\x7f\x02\r\n".encode(),
    "bare LF in value": f"Authorization: Bearer {SECRET}\nX: y\r\n".encode(),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_HEADERS))
async def test_malformed_headers_never_reach_the_log(engines, router, caplog, case):
    client = await router(placement_text(engines))
    caplog.set_level(logging.DEBUG)
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               + MALFORMED_HEADERS[case] + f"Content-Length: {len(BODY)}\r\n\r\n".encode() + BODY)
    answer = await _raw_exchange(client.server.port, request)
    assert answer == b"" or answer.split(b" ", 2)[1].startswith(b"4"), answer[:200]
    await asyncio.sleep(0.2)  # aiohttp logs after answering
    formatter = logging.Formatter()
    logged = "\n".join(formatter.format(record) for record in caplog.records)
    assert SECRET not in logged
    assert [r for r in caplog.records if "not logged" in r.getMessage()], logged[-2000:]
    assert all(not e.seen for e in engines)  # the malformed request was not forwarded
    assert (await client.get("/health")).status == 200
    response = await client.post("/v1/completions", data=BODY)
    assert response.status == 200 and (await response.json())["choices"][0]["text"].startswith("from p")
