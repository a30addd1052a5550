"""Server test material: one tiny model, adapters under one adapter root, a live server harness, references.

The live server runs in a thread with its own event loop on a free loopback port (`serve` from the CLI
module, the code path `kubelora engine serve` takes), so tests drive it with the openai SDK and may also look
at the engine inside it.
"""

from __future__ import annotations

import asyncio
import json
import socketserver
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kubelora.engine.config import EngineConfig
from kubelora.engine.server.config import ENGINE_FIELDS, ServerConfig

# name -> (rank, alpha, targets, seed): mixed ranks and target sets.
ADAPTERS = {
    f"a{i}": (rank, 2 * rank, targets, 10 + i)
    for i, (rank, targets) in enumerate([(4, "q_proj,v_proj"), (8, "all-linear"), (16, "q_proj,k_proj,v_proj,o_proj"),
                                         (8, "q_proj,v_proj"), (4, "all-linear"), (16, "q_proj,v_proj"),
                                         (8, "q_proj,k_proj,v_proj,o_proj"), (8, "all-linear")])
}
MAX_LORA_RANK = 16
MAX_MODEL_LEN = 512


@dataclass(frozen=True)
class Material:
    root: Path
    model_dir: Path
    adapter_root: Path
    adapters: dict[str, Path]  # the eight served adapters
    extra: dict[str, Path] = field(default_factory=dict)  # revisions and bad adapters, also under the root


def _corrupt(path: Path, good: Path) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    (path / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    return path


@pytest.fixture(scope="session")
def material(tmp_path_factory) -> Material:
    from kubelora.cli.tiny import make_adapter, make_tiny_model

    root = tmp_path_factory.mktemp("server")
    model_dir = make_tiny_model(root / "model", arch="llama", seed=0)
    other_model = make_tiny_model(root / "other-model", arch="llama", seed=1, hidden_size=32, num_heads=2,
                                  num_kv_heads=1)
    adapter_root = root / "adapters"
    adapters = {name: make_adapter(adapter_root / name, model_dir, rank=rank, alpha=alpha, targets=targets, seed=seed)
                for name, (rank, alpha, targets, seed) in ADAPTERS.items()}
    extra = {
        "rev1": make_adapter(adapter_root / "rev" / "v1", model_dir, rank=8, seed=101),
        "rev2": make_adapter(adapter_root / "rev" / "v2", model_dir, rank=4, seed=102),
        "late": make_adapter(adapter_root / "late", model_dir, rank=8, targets="all-linear", seed=103),
        "rank32": make_adapter(adapter_root / "rank32", model_dir, rank=32, seed=104),
        "wrong-base": make_adapter(adapter_root / "wrong-base", other_model, rank=8, seed=105),
    }
    extra["corrupt"] = _corrupt(adapter_root / "corrupt", adapters["a0"])
    return Material(root, model_dir, adapter_root, adapters, extra)


def server_config(material: Material, **overrides) -> ServerConfig:
    """Overrides name EngineConfig or ServerConfig fields."""
    engine = {"model_dir": str(material.model_dir), "max_loras": 2, "max_lora_rank": MAX_LORA_RANK,
              "max_cpu_loras": 4, "max_model_len": MAX_MODEL_LEN}
    server = {"host": "127.0.0.1", "port": 0, "adapter_root": (str(material.adapter_root),),
              "adapter_cache_dir": str(material.root / "cache")}
    for name, value in overrides.items():
        (engine if name in ENGINE_FIELDS else server)[name] = value
    return ServerConfig(engine=EngineConfig(**engine), **server)


class SlowEngine:
    """A real engine whose steps take at least `step_s`: requests stay in flight long enough for a test to act
    on them (load, unload, disconnect) however fast the machine is."""

    def __init__(self, engine, step_s: float) -> None:
        self._engine = engine
        self._step_s = step_s

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self):
        started = time.monotonic()
        outputs = self._engine.step()
        time.sleep(max(0.0, self._step_s - (time.monotonic() - started)))
        return outputs


class LiveServer:
    """`serve(build_app(config))` in a thread; `url`, `admin_url`, `lifecycle` (the engine inside) once started."""

    def __init__(self, config: ServerConfig, min_step_s: float = 0.0) -> None:
        from kubelora.engine.server.app import LIFECYCLE, build_app, build_engine

        factory = build_engine
        if min_step_s:
            factory = lambda c: SlowEngine(build_engine(c), min_step_s)  # noqa: E731
        self.app = build_app(config, factory)
        self.lifecycle = self.app[LIFECYCLE]
        self.admin_token = config.admin_token
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._port: int | None = None
        self._admin_port: int | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.exit_code: int | None = None

    def _run(self) -> None:
        from kubelora.engine.server import cli

        asyncio.set_event_loop(self._loop)
        self._stop = asyncio.Event()
        self.exit_code = self._loop.run_until_complete(
            cli.serve(self.app, "127.0.0.1", 0, self._stop, on_listening=self._set_port, admin_port=0,
                      on_admin_listening=self._set_admin_port))

    def _set_port(self, addresses: list) -> None:
        self._port = addresses[0][1]

    def _set_admin_port(self, addresses: list) -> None:
        self._admin_port = addresses[0][1]

    def start(self, timeout_s: float = 60.0) -> LiveServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._port is not None and self.lifecycle.done.is_set():
                if self.lifecycle.failure is not None:
                    raise RuntimeError(f"server failed to start: {self.lifecycle.failure}")
                return self
            time.sleep(0.05)
        raise TimeoutError("server did not start")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self._admin_port}"

    @property
    def serving(self):
        return self.lifecycle.serving

    def encode(self, text: str) -> list[int]:
        """`text` tokenized as the server tokenizes prompts (on its tokenizer thread)."""
        future = asyncio.run_coroutine_threadsafe(self.serving.prompts.encode((text,)), self._loop)
        return future.result(timeout=30)[0]

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, **kwargs)

    def async_client(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, **kwargs)

    def post(self, path: str, body: dict | bytes, token: str | None = None) -> tuple[int, dict]:
        """POST to the serving port."""
        return self._post(self.url + path, body, token)

    def admin_post(self, path: str, body: dict | bytes, token: str | None = None) -> tuple[int, dict]:
        """POST to the admin port, with the configured admin token unless `token` is given ("" for none)."""
        return self._post(self.admin_url + path, body, self.admin_token if token is None else token)

    @staticmethod
    def _post(url: str, body: dict | bytes, token: str | None) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return _call(urllib.request.Request(url, data=data, headers=headers, method="POST"))

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def load(self, name: str, path: Path | str, **extra) -> dict:
        status, body = self.admin_post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path), **extra})
        assert status == 200, body
        return body

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)


def _call(request: urllib.request.Request) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="session")
def slow_engine_factory():
    """`slow_engine_factory(step_s)` -> an engine factory for build_app whose steps take at least step_s."""
    from kubelora.engine.server.app import build_engine

    return lambda step_s: (lambda config: SlowEngine(build_engine(config), step_s))


@pytest.fixture(scope="session")
def config_for(material):
    """`config_for(**overrides)` -> the ServerConfig tests start from."""
    return lambda **overrides: server_config(material, **overrides)


@pytest.fixture
def live_server(material):
    """A factory: `live_server(min_step_s=0, **config overrides)` starts one; all are stopped after the test."""
    servers: list[LiveServer] = []

    def start(min_step_s: float = 0.0, **overrides) -> LiveServer:
        server = LiveServer(server_config(material, **overrides), min_step_s).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def reference(material):
    """Offline greedy texts: `reference(adapter_name_or_None, [prompt_token_ids, ...], max_tokens)` -> texts."""
    from kubelora.engine import LLM, SamplingParams

    llm = LLM(str(material.model_dir), max_loras=8, max_lora_rank=MAX_LORA_RANK, max_cpu_loras=16,
              max_model_len=MAX_MODEL_LEN)
    paths = {**material.adapters, **material.extra}
    cache: dict[tuple, str] = {}

    def run(adapter: str | None, prompts: list[list[int]], max_tokens: int) -> list[str]:
        missing = [p for p in prompts if (adapter, tuple(p), max_tokens) not in cache]
        if adapter is not None and llm.engine.adapters.get(adapter) is None:
            llm.load_adapter(adapter, paths[adapter])
        if missing:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            for p, result in zip(missing, llm.generate(missing, params, adapters=adapter)):
                cache[(adapter, tuple(p), max_tokens)] = result.text
        return [cache[(adapter, tuple(p), max_tokens)] for p in prompts]

    yield run
    llm.close()


@pytest.fixture
def start_app(aiohttp_client):
    """`await start_app(config, engine_factory=build_engine)` -> an aiohttp test client of a started server's
    serving port; `client.admin` is one of its admin port (the admin token, if any, is not added)."""
    from kubelora.engine.server.app import ADMIN_APP, LIFECYCLE, build_app, build_engine

    async def start(config: ServerConfig, engine_factory=build_engine):
        app = build_app(config, engine_factory)
        client = await aiohttp_client(app)
        client.admin = await aiohttp_client(app[ADMIN_APP])
        await asyncio.wait_for(app[LIFECYCLE].done.wait(), 60)
        assert app[LIFECYCLE].failure is None, app[LIFECYCLE].failure
        return client

    return start


async def expect_error(response, status: int, type_: str, param: str | None = None, code: str | None = None) -> dict:
    """The OpenAI-shaped error body of `response`, checked; returns its `error` object."""
    body = await response.json()
    assert response.status == status, body
    error = body["error"]
    assert set(error) - {"retryable"} == {"message", "type", "param", "code"} and error["type"] == type_, body
    assert "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param, body
    if code is not None:
        assert error["code"] == code, body
    return error


@pytest.fixture(scope="session")
def api_error():
    """`await api_error(response, status, type, param=None, code=None)`: see `expect_error`."""
    return expect_error


class _MisbehavingSource(socketserver.BaseRequestHandler):
    """By path: `/trickle/<s>/...` a declared 1000-byte body, one byte every s seconds; `/trickle-close/<s>/...`
    the same without Content-Length (the body ends when the connection does); `/slow-headers/<s>/...` one byte of
    headers every s seconds; `/short/...` declares 1000 bytes, sends 10 and closes."""

    def handle(self) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.request.recv(4096)
            if not chunk:
                return
            head += chunk
        kind, *rest = head.split(b" ", 2)[1].decode().strip("/").split("/")
        try:
            if kind == "short":
                self.request.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"x" * 10)
            elif kind in ("trickle", "trickle-close", "slow-headers"):
                interval = float(rest[0])
                length = b"Content-Length: 1000\r\n" if kind == "trickle" else b""
                status = b"HTTP/1.0 200 OK\r\n" + length + b"\r\n"
                self._drip(status if kind == "slow-headers" else b"", interval)
                self.request.sendall(b"" if kind == "slow-headers" else status)
                self._drip(b"x" * 1000, interval)
        except OSError:
            pass  # the engine gave up on us: what the test wants

    def _drip(self, data: bytes, interval: float) -> None:
        for i in range(len(data)):
            self.request.sendall(data[i:i + 1])
            time.sleep(interval)


class _ThreadingServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


@pytest.fixture
def misbehaving_source():
    """`host:port` of a local HTTP source that trickles, stalls or cuts its bodies short (see _MisbehavingSource)."""
    server = _ThreadingServer(("127.0.0.1", 0), _MisbehavingSource)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
