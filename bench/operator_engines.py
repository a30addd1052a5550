"""Fake engine pods for `kubelora bench operator`: a test double (the real engine is covered by the e2e tests).

One process serves every fake pod of the fleet, each on its own loopback address (its pod IP, 127.A.B.x) and the
engine's two fixed ports. A fake is configured as an engine pod is: from the engine Deployment's container args and
the admin token its env names, through the engine's own `resolve_config`. What it answers is the engine's own code:
the admin app is built of `AdminRoutes` (the full model list with its ETag and long poll, load, unload, the API
key table), the admin token and error middlewares and the request parsers, and every load resolves its source
with `resolve_source` (local paths confined to the adapter roots; the bench makes each adapter an empty directory
there). Only what stands behind `Serving` is a stand-in:

- `FakeAdapters` replaces the AdapterManager: the same semantics on names, revisions and tiers (the same revision
  again is a no-op, or staged into the host tier by a preload; another revision needs `load_inplace`, else
  `AdapterExists`; unload is idempotent), but no weights are read: a revision is a digest of the path, every
  adapter has the bench's rank on q/k/v/o, its `bytes` follow `BYTES_PER_RANK`, and the device pool's budget
  (`adapter_pool_bytes`) is maxLoras adapters of maxLoraRank. The host tier never evicts (no traffic loads
  anything on demand).
- No model and no traffic: the serving port answers `/health` and `/ready` only, `tokens_served` stays 0, and
  `ServerMetrics` is replaced by `FakeMetrics` (one load histogram per adapter and pod is what a real engine keeps
  in its own process; 16 x 2,500 of them in one process is not).

Every request is counted per pod, and every load and unload per adapter (`GET /counts` on the control port): the
bench checks one GET per pod and pass and one engine call per adapter and pod against these counts.

    python -P -m kubelora.bench.operator_engines CONFIG.json    # FakeFleetConfig as JSON
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from aiohttp import web

from kubelora.contract.aio_serve import app_runner, install_stop_signals
from kubelora.contract.errors import AdapterExists
from kubelora.contract.http_errors import HANDLER_ARGS
from kubelora.engine.adapters.types import AdapterInfo, AdapterStats
from kubelora.engine.server import config as server_config
from kubelora.engine.server.adapter_ops import AdapterOps
from kubelora.engine.server.admin_api import AdminRoutes, admin_auth_middleware
from kubelora.engine.server.api_keys import KEY_GATE, KeyGate
from kubelora.engine.server.app import MAX_BODY_BYTES, MIDDLEWARES, source_config
from kubelora.engine.server.serving import Serving

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# Device pool bytes per unit of rank: A and B rows of q, k, v, o (in+out: 2048+2048, 2048+512, 2048+512,
# 2048+2048) over 16 layers in bf16, a 1B-class model with grouped k/v.
BYTES_PER_RANK = 16 * (4096 + 2560 + 2560 + 4096) * 2
REQUEST_KINDS = ("list", "watch", "load", "unload", "put_keys", "other")


@dataclass(frozen=True)
class FakeFleetConfig:
    """What the fakes process is told: the pod IPs to serve, the engine container's args and env as the
    Deployment renders them (the admin token resolved from its Secret), and the adapters' rank."""
    ips: tuple[str, ...]
    engine_args: tuple[str, ...]  # after `kubelora engine serve`
    env: dict[str, str] = field(default_factory=dict)
    rank: int = 8
    control_port: int = 0

    def __post_init__(self) -> None:
        if not self.ips:
            raise ValueError("FakeFleetConfig.ips must name at least one pod IP")
        if self.rank < 1:
            raise ValueError(f"FakeFleetConfig.rank must be >= 1, got {self.rank}")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> FakeFleetConfig:
        raw = json.loads(text)
        return cls(tuple(raw["ips"]), tuple(raw["engine_args"]), dict(raw["env"]), raw["rank"], raw["control_port"])


@dataclass
class PodCounts:
    """One fake pod's calls: requests by kind, and per adapter its loads (preloads and registrations apart) and
    unloads."""
    requests: Counter = field(default_factory=Counter)
    preloads: Counter = field(default_factory=Counter)
    registrations: Counter = field(default_factory=Counter)
    unloads: Counter = field(default_factory=Counter)

    def as_json(self) -> dict:
        return {"requests": dict(self.requests), "preloads": dict(self.preloads),
                "registrations": dict(self.registrations), "unloads": dict(self.unloads)}


class FakeAdapters:
    """Stands in for the engine's AdapterManager behind `Serving` (see the module docstring). Thread-safe: loads
    run on the admin thread pool, unloads on their own thread."""

    def __init__(self, base_model: str, rank: int, budget_bytes: int) -> None:
        self._base_model, self._rank, self._budget = base_model, rank, budget_bytes
        self._lock = threading.Lock()
        self._entries: dict[str, AdapterInfo] = {}

    def load(self, name: str, path: str | Path, *, load_inplace: bool = False, preload: bool = True) -> AdapterInfo:
        revision = hashlib.sha256(str(path).encode()).hexdigest()[:12]
        with self._lock:
            current = self._entries.get(name)
            if current is not None and current.revision == revision:
                if preload and current.tier == "known":
                    current = self._entries[name] = replace(current, tier="host", host_bytes=current.bytes)
                return current
            if current is not None and not load_inplace:
                raise AdapterExists(name, f"already loaded from {current.path!r} (revision {current.revision}); "
                                          f"the new {str(path)!r} (revision {revision}) needs load_inplace=true")
            num_bytes = self._rank * BYTES_PER_RANK
            info = AdapterInfo(name, revision, str(path), "host" if preload else "known", self._rank,
                               dict.fromkeys(TARGETS, self._rank), TARGETS, num_bytes, num_bytes if preload else 0,
                               time.time(), self._base_model, 0, False, False, None)
            self._entries[name] = info
            return info

    def unload(self, name: str) -> bool:
        with self._lock:
            return self._entries.pop(name, None) is not None

    def list(self) -> list[AdapterInfo]:
        with self._lock:
            return [self._entries[name] for name in sorted(self._entries)]

    def get(self, name: str) -> AdapterInfo | None:
        with self._lock:
            return self._entries.get(name)

    def module_costs(self) -> dict[str, dict[str, int]]:
        """Each target module's share of BYTES_PER_RANK, so an adapter's bytes are what the costs give."""
        return {module: {"per_rank": BYTES_PER_RANK // len(TARGETS), "fixed": 0} for module in TARGETS}

    def stats(self) -> AdapterStats:
        with self._lock:
            host = sum(info.host_bytes for info in self._entries.values())
        return AdapterStats(host, 0, self._budget, 0, 0, 0, 0, ())


class FakeMetrics:
    """What the admin routes read and write of `ServerMetrics`: the demand counters (no traffic: empty) and the
    load histogram (not kept)."""

    def __init__(self) -> None:
        self.tokens_served: dict[str, int] = {}

    def observe_load(self, adapter: str, seconds: float) -> None:
        pass


class FakeEngineState:
    """`Serving.engine` as the probes read it: running, never failed."""
    failure = None
    is_running = True


def count_requests(counts: PodCounts):
    """Outermost on the admin app: every request by kind, and every load and unload by the adapter it names,
    whatever the answer (a refused call is a call)."""

    @web.middleware
    async def middleware(request: web.Request, handler):
        kind = request_kind(request)
        counts.requests[kind] += 1
        if kind in ("load", "unload"):
            try:
                body = await request.json()  # aiohttp keeps the body: the handler reads it again
            except ValueError:
                body = None
            if isinstance(body, dict) and isinstance(body.get("lora_name"), str):
                name = body["lora_name"]
                if kind == "unload":
                    counts.unloads[name] += 1
                else:
                    (counts.preloads if body.get("preload", True) is not False else counts.registrations)[name] += 1
        return await handler(request)

    return middleware


def request_kind(request: web.Request) -> str:
    path, method = request.path, request.method
    if method == "GET" and path == "/v1/models":
        return "watch" if "changed_since" in request.query else "list"
    kinds = {("POST", "/v1/load_lora_adapter"): "load", ("POST", "/v1/unload_lora_adapter"): "unload",
             ("PUT", "/v1/api_keys"): "put_keys"}
    return kinds.get((method, path), "other")


@dataclass(frozen=True)
class FakePod:
    app: web.Application  # the serving port's
    admin: web.Application  # the admin port's
    adapters: FakeAdapters
    counts: PodCounts


def build_fake_pod(config: server_config.ServerConfig, rank: int) -> FakePod:
    """One fake pod; its admin app assembled as `build_app` assembles the engine's."""
    engine = config.engine
    budget = engine.max_loras * engine.max_lora_rank * BYTES_PER_RANK
    served_name = engine.served_model_name
    adapters, counts = FakeAdapters(served_name, rank, budget), PodCounts()
    serving = Serving(FakeEngineState(), adapters, None, served_name, engine.max_model_len, FakeMetrics(),
                      source_config(config), AdapterOps(), time.time())
    keys = KeyGate(config.require_api_keys)
    admin = web.Application(middlewares=[count_requests(counts), *MIDDLEWARES,
                                         admin_auth_middleware(config.admin_token)],
                            client_max_size=MAX_BODY_BYTES, handler_args=HANDLER_ARGS)
    admin[KEY_GATE] = keys
    AdminRoutes(lambda: serving, config.admin_token, keys).add_to(admin)
    app = web.Application(middlewares=MIDDLEWARES, handler_args=HANDLER_ARGS)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    return FakePod(app, admin, adapters, counts)


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    return web.json_response({"status": "ready"})


def resolve_engine_config(fleet: FakeFleetConfig) -> server_config.ServerConfig:
    """The engine's own settings from the Deployment's container args and env."""
    parser = argparse.ArgumentParser(prog="kubelora engine serve")
    server_config.add_arguments(parser)
    return server_config.resolve_config(parser.parse_args(list(fleet.engine_args)), fleet.env)


def build_control_app(pods: dict[str, FakePod]) -> web.Application:
    """The bench's view of the fakes: `GET /counts` (pod IP -> PodCounts.as_json), `GET /requests` (pod IP -> its
    requests by kind: the light part) and `GET /held?prefix=P` (pod IP -> how many adapters whose names start with
    P the pod holds)."""

    async def counts(request: web.Request) -> web.Response:
        return web.json_response({ip: pod.counts.as_json() for ip, pod in pods.items()})

    async def held(request: web.Request) -> web.Response:
        prefix = request.query.get("prefix", "")
        return web.json_response({ip: sum(1 for info in pod.adapters.list() if info.name.startswith(prefix))
                                  for ip, pod in pods.items()})

    async def requests(request: web.Request) -> web.Response:
        return web.json_response({ip: dict(pod.counts.requests) for ip, pod in pods.items()})

    control = web.Application()
    control.router.add_get("/counts", counts)
    control.router.add_get("/requests", requests)
    control.router.add_get("/held", held)
    return control


async def serve_fleet(fleet: FakeFleetConfig, stop: asyncio.Event) -> None:
    """Every fake pod on its IP and the engine's ports, and the control app on 127.0.0.1, until `stop`."""
    config = resolve_engine_config(fleet)
    pods = {ip: build_fake_pod(config, fleet.rank) for ip in fleet.ips}
    runners = []
    for ip, pod in pods.items():  # the admin site first, as the engine does: never a serving pod it cannot manage
        for app, port in ((pod.admin, config.admin_port), (pod.app, config.port)):
            runner = app_runner(app, is_access_log=False)
            await runner.setup()
            await web.TCPSite(runner, ip, port).start()
            runners.append(runner)
    runner = app_runner(build_control_app(pods), is_access_log=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", fleet.control_port).start()
    runners.append(runner)
    print("listening", flush=True)  # the bench waits for this line
    try:
        await stop.wait()
    finally:
        for runner in reversed(runners):
            await runner.cleanup()


async def _main(fleet: FakeFleetConfig) -> None:
    stop = asyncio.Event()
    install_stop_signals(stop)
    await serve_fleet(fleet, stop)


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    fleet = FakeFleetConfig.from_json(Path(args[0]).read_text())
    asyncio.run(_main(fleet))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
