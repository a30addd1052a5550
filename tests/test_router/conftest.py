"""Router test material: fake engines (aiohttp test servers) and a router app in front of them."""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

from kubelora.router.app import STATE, build_app
from kubelora.router.config import RouterConfig
from kubelora.router.placement import parse_placement
from kubelora.router.sources import PlacementStore


@dataclass
class FakeEngine:
    """Answers completions like an engine: JSON, or SSE when `stream` is set. `gate` holds streams after the
    first chunk until it is set; `seen` lists the models it was asked for; `cancelled` counts requests whose
    client went away mid-answer."""

    name: str
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    seen: list[str] = field(default_factory=list)
    headers: list = field(default_factory=list)  # request headers, one CIMultiDictProxy per request
    cancelled: int = 0
    status: int = 200
    is_breaking: bool = False  # drop the connection after the first chunk (a crashed engine)
    url: str = ""

    def __post_init__(self) -> None:
        self.gate.set()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        return app

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(body["model"])
        self.headers.append(request.headers)
        if self.status != 200:
            return web.json_response({"error": {"message": "busy", "type": "rate_limit_error", "param": None,
                                                "code": "queue_full"}}, status=self.status,
                                     headers={"Retry-After": "3"})
        if not body.get("stream"):
            try:
                await self.gate.wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            if self.is_breaking:
                return await self._break(request, b'{"object": "text_completion", ', "application/json")
            return web.json_response({"object": "text_completion", "model": body["model"], "engine": self.name,
                                      "choices": [{"index": 0, "text": f"from {self.name}", "finish_reason": "stop"}]})
        if self.is_breaking:
            return await self._break(request, b'data: {"choices": [{"index": 0, "text": "0 "}]}\n\n',
                                     "text/event-stream")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for i in range(3):
                chunk = {"object": "text_completion", "model": body["model"], "engine": self.name,
                         "choices": [{"index": 0, "text": f"{i} ", "finish_reason": None}]}
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await self.gate.wait()
            await response.write(b"data: [DONE]\n\n")
        except (asyncio.CancelledError, ConnectionResetError):
            self.cancelled += 1
            raise
        return response

    async def _break(self, request: web.Request, first: bytes, content_type: str) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": content_type})
        response.content_length = 1000  # promised, never delivered
        await response.prepare(request)
        await response.write(first)
        request.transport.close()
        return response


@pytest.fixture
async def engines(aiohttp_server):
    """Three fake engines p0, p1, p2, started."""
    fakes = []
    for i in range(3):
        fake = FakeEngine(f"p{i}")
        server = await aiohttp_server(fake.app())
        fake.url = str(server.make_url("")).rstrip("/")
        fakes.append(fake)
    return fakes


def placement_text(engines, *, ready=None, adapters=None, revision=1, extra_replicas=()) -> str:
    ready = {e.name for e in engines} if ready is None else set(ready)
    replicas = [{"pod": e.name, "url": e.url, "ready": e.name in ready} for e in engines]
    return json.dumps({"pool": "p", "baseModel": "base", "revision": revision,
                       "replicas": replicas + list(extra_replicas), "adapters": adapters or {}})


@pytest.fixture
async def router(aiohttp_client):
    """`await router(placement_text_or_None, **config)` -> a test client of a router app with that placement."""

    async def start(text: str | None, **overrides):
        store = PlacementStore()
        if text is not None:
            store.set(parse_placement(text))
        config = RouterConfig(**{"pool": "p", "placement_configmap": "p-placement", **overrides})
        client = await aiohttp_client(build_app(config, store))  # test servers cancel handlers on disconnect
        client.state = client.app[STATE]
        return client

    return start


# The local e2e cluster (docs/cluster.md) for test_in_cluster.py; e2e/ is not on sys.path under -P.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e"))
from pytest_cluster import cluster  # noqa: E402,F401  (a fixture, registered by import)
