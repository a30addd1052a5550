"""The engine benchmark through HTTP: `kubelora engine serve` in a subprocess, streaming clients from one asyncio loop.

Each client POSTs one streamed completion (prompt as token ids, greedy, ignore_eos, usage in the last chunk) and
reads the SSE stream with aiohttp; TTFT is from sending the request to the first chunk that carries text, and
tokens/s is the completion tokens of all clients over the wall time from the first send to the last [DONE].
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kubelora.bench.engine_offline import RunStats, Workload

SERVED_NAME = "base"  # the base model's name in requests and in the server's metrics labels
STOP_GRACE_S = 2.0  # SIGTERM, then SIGKILL: the server's graceful drain (seconds) buys the benchmark nothing


@dataclass(frozen=True)
class ServerSettings:
    model_dir: Path
    adapters: dict[str, Path]  # loaded with --lora before /ready
    device: str
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    max_model_len: int
    max_num_seqs: int
    engine_flags: tuple[str, ...] = ()  # more `engine serve` flags (e.g. --enforce-eager), each one it takes


def server_flags() -> frozenset[str]:
    """The flags `kubelora engine serve` takes: its settings table."""
    from kubelora.engine.server.config import SETTINGS

    return frozenset(s.flag for s in SETTINGS)


class Server:
    """`kubelora engine serve` on a free loopback port; stop() ends it (SIGTERM, then SIGKILL)."""

    def __init__(self, settings: ServerSettings, log_path: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-P", "-m", "kubelora.cli.main", "engine", "serve",
                   "--model", str(settings.model_dir), "--served-model-name", SERVED_NAME,
                   "--max-loras", str(settings.max_loras), "--max-lora-rank", str(settings.max_lora_rank),
                   "--max-cpu-loras", str(settings.max_cpu_loras), "--max-model-len", str(settings.max_model_len),
                   "--max-num-seqs", str(settings.max_num_seqs), "--device", settings.device,
                   "--host", "127.0.0.1", "--port", str(self.port), "--admin-port", "0", "--log-level", "warning"]
        command += list(settings.engine_flags)
        for name, path in settings.adapters.items():
            command += ["--lora", f"{name}={path}"]
        self._log = log_path.open("w")
        self.started = time.perf_counter()
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "PYTHONSAFEPATH": "1"})
        self.log_path = log_path

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds from the start to /ready 200."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}: {self._tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/ready", timeout=5) as response:
                    if response.status == 200:
                        return time.perf_counter() - self.started
            except OSError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"the server was not ready after {timeout_s:.0f} s: {self._tail()}")

    def _tail(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-2000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _stream_one(session, url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
    """(send time, TTFT in s, completion tokens) of one streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    ttft, num_tokens = None, 0
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:500]}")
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if ttft is None and any(c.get("text") for c in chunk.get("choices", ())):
                ttft = time.perf_counter() - sent
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
    if ttft is None:
        raise RuntimeError(f"a stream for {model} carried no text")
    return sent, ttft, num_tokens


async def _run_clients(url: str, workload: Workload) -> RunStats:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        start = time.perf_counter()
        results = await asyncio.gather(*(_stream_one(session, url, adapter or SERVED_NAME, prompt, workload.max_tokens)
                                         for prompt, adapter in zip(workload.prompts, workload.adapters)))
        seconds = time.perf_counter() - start
    return RunStats(seconds=seconds, num_tokens=sum(n for _, _, n in results), decode_ms=None, num_steps=0,
                    ttft_s=[t for _, t, _ in results])


def server_split(url: str, adapter: str) -> tuple[float, float]:
    """The server's summed queue and prefill seconds of `adapter`'s finished requests (its /metrics histograms):
    the difference across one request is where that request's time to first token went inside the server."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    names = {f"kubelora_request_{part}_time_seconds_sum": part for part in ("queue", "prefill")}
    sums = {"queue": 0.0, "prefill": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names and sample.labels.get("adapter") == adapter:
                sums[names[sample.name]] = sample.value
    return sums["queue"], sums["prefill"]


def probe_ttft(url: str, workload: Workload) -> tuple[float, float, float]:
    """One request alone: (TTFT at the client, its queue and prefill seconds in the server)."""
    adapter = workload.adapters[0] or SERVED_NAME
    queue, prefill = server_split(url, adapter)
    ttft = run_clients(url, workload).ttft_s[0]
    queue_after, prefill_after = server_split(url, adapter)
    return ttft, queue_after - queue, prefill_after - prefill


def run_clients(url: str, workload: Workload) -> RunStats:
    """All of the workload's requests at once, one streaming client each."""
    return asyncio.run(_run_clients(url, workload))
