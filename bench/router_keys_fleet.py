"""The router-keys benchmark's processes: a fake engine, `kubelora router` processes reading placement files, their
CPU clocks, and handing a router another arm's placement between blocks."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kubelora.bench.hostile import free_port

ENGINE_ANSWER = json.dumps({"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "bench",
                            "choices": [{"index": 0, "text": " hello", "finish_reason": "stop", "logprobs": None}],
                            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}).encode()
PLACEMENT_WAIT_S = 5.0
_LIBC = ctypes.CDLL(None, use_errno=True)


def serve_engine(port: int) -> None:
    """The fake engine: every completion is answered ENGINE_ANSWER at once (the body is read, not parsed)."""
    from aiohttp import web

    async def complete(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=ENGINE_ANSWER, content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def process_cpu_s(pid: int) -> float:
    """CPU seconds of a process, all its threads, from its CPU clock (ns resolution; /proc's ticks are 10 ms)."""
    clock = ctypes.c_int()
    if _LIBC.clock_getcpuclockid(pid, ctypes.byref(clock)) != 0:
        raise RuntimeError(f"no CPU clock for process {pid}")
    return time.clock_gettime(clock.value)


@dataclass
class Fleet:
    """The engine and the routers in front of it; router j reads `placement_files[j]`."""
    engine_url: str
    router_urls: list[str] = field(default_factory=list)
    placement_files: list[Path] = field(default_factory=list)
    processes: list[subprocess.Popen] = field(default_factory=list)  # the engine first
    revision: int = 0  # the last placement revision handed out

    @property
    def router_pids(self) -> list[int]:
        return [p.pid for p in self.processes[1:]]

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def start_fleet(workdir: Path, num_routers: int, first_placement: dict, timeout_s: float) -> Fleet:
    """The engine and `num_routers` routers, all ready, each on `first_placement` (its engine URL filled in)."""
    port = free_port()
    fleet = Fleet(f"http://127.0.0.1:{port}")
    code = f"from kubelora.bench.router_keys_fleet import serve_engine; serve_engine({port})"
    fleet.processes.append(subprocess.Popen([sys.executable, "-P", "-c", code], stdout=subprocess.DEVNULL))
    try:
        _wait_ready(f"{fleet.engine_url}/health", fleet.processes[0], timeout_s)
        for j in range(num_routers):
            fleet.placement_files.append(workdir / f"placement-{j}.json")
            _write(fleet.placement_files[-1], {**first_placement, "revision": 0}, fleet.engine_url)
            port = free_port()
            fleet.router_urls.append(f"http://127.0.0.1:{port}")
            fleet.processes.append(_start_router(fleet.placement_files[-1], port))
        for url, process in zip(fleet.router_urls, fleet.processes[1:]):
            _wait_ready(f"{url}/ready", process, timeout_s)
    except BaseException:
        fleet.stop()
        raise
    return fleet


async def hand_out(session, fleet: Fleet, placements: list[dict]) -> None:
    """Router j routes on `placements[j]` once this returns: written under a new revision, each router asked to
    read it now (`GET /placement?min_revision=`) instead of at its next poll."""
    fleet.revision += 1
    for path, placement in zip(fleet.placement_files, placements):
        _write(path, {**placement, "revision": fleet.revision}, fleet.engine_url)
    for url in fleet.router_urls:
        query = f"{url}/placement?min_revision={fleet.revision}&wait={PLACEMENT_WAIT_S:g}"
        async with session.get(query) as response:
            revision = (await response.json())["revision"]
        if revision != fleet.revision:
            raise RuntimeError(f"router {url} routes on revision {revision}, not {fleet.revision}")


def _write(path: Path, placement: dict, engine_url: str) -> None:
    replicas = [{"pod": "engine-0", "url": engine_url, "ready": True}]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**placement, "replicas": replicas}))
    os.replace(tmp, path)  # a router never reads half a file


def _start_router(placement_file: Path, port: int) -> subprocess.Popen:
    """`kubelora router` as it runs from a file; it polls only every 60 s, so reads happen when handed out."""
    command = [sys.executable, "-P", "-m", "kubelora.cli.main", "router", "--placement-file", str(placement_file),
               "--host", "127.0.0.1", "--port", str(port), "--poll-interval", "60", "--max-placement-age", "0",
               "--log-level", "warning"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBELORA_ROUTER_")}
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, env=env)


def _wait_ready(url: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} was not ready within {timeout_s:g} s")
