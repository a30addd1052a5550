"""One hostile class measured against a live server: the victim beside the plain twin, then beside the hostile
request, while a poller times `/health`.

A run sends its request (hostile or plain) and, at once, the victim: a greedy base-model completion of the same
token count on another connection. The victim's time is from its send to its whole answer; `/health` is timed
from a thread of its own (one keep-alive connection, one GET every `interval_s`) from before the send until
both answers are in.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import statistics
import threading
import time
from dataclasses import dataclass, field

from kubelora.bench.hostile_classes import HostileClass, Probe

HEALTH_TIMEOUT_S = 10.0  # a /health answer slower than this counts as its timeout


@dataclass(frozen=True)
class Endpoints:
    url: str  # the serving port
    admin_url: str


@dataclass(frozen=True)
class RunResult:
    """One run: the request's status, the victim's seconds and text, /health latencies in seconds."""

    status: int
    victim_s: float
    victim_text: str | None  # None when the victim was not answered 200
    health_s: tuple[float, ...]
    num_health_errors: int


@dataclass
class ClassResult:
    name: str
    statuses: list[int] = field(default_factory=list)  # the hostile request's, one per repeat
    plain_victim_s: list[float] = field(default_factory=list)
    hostile_victim_s: list[float] = field(default_factory=list)
    health_s: list[float] = field(default_factory=list)  # during the hostile runs
    num_health_errors: int = 0
    is_victim_equal: bool = True  # every hostile run's victim answered what it answers alone

    @property
    def is_refused(self) -> bool:
        return all(400 <= s < 500 for s in self.statuses)

    @property
    def victim_ratio(self) -> float:
        return statistics.median(self.hostile_victim_s) / statistics.median(self.plain_victim_s)

    @property
    def health_p99_ms(self) -> float:
        return 1e3 * percentile(self.health_s, 0.99)

    @property
    def health_max_ms(self) -> float:
        return 1e3 * max(self.health_s, default=float("nan"))


def percentile(values: list[float], q: float) -> float:
    """The q-quantile by the nearest rank (NaN for no values)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


class HealthPoller:
    """GET /health every `interval_s` on one connection, in a thread, until stop(); latencies in seconds."""

    def __init__(self, url: str, interval_s: float) -> None:
        host, port = url.removeprefix("http://").split(":")
        self._address = (host, int(port))
        self._interval_s = interval_s
        self._stop = threading.Event()
        self.latencies: list[float] = []
        self.num_errors = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        connection = http.client.HTTPConnection(*self._address, timeout=HEALTH_TIMEOUT_S)
        while not self._stop.is_set():
            started = time.perf_counter()
            try:
                connection.request("GET", "/health")
                response = connection.getresponse()
                response.read()
                if response.status != 200:
                    self.num_errors += 1
            except OSError:
                self.num_errors += 1
                connection.close()
            latency = time.perf_counter() - started
            self.latencies.append(latency)
            self._stop.wait(max(0.0, self._interval_s - latency))
        connection.close()


async def send(session, endpoints: Endpoints, probe: Probe) -> tuple[int, dict | None]:
    """(status, JSON body or None); a connection the server cuts off is status 0."""
    import aiohttp

    url = (endpoints.admin_url if probe.is_admin else endpoints.url) + probe.path
    try:
        async with session.post(url, data=probe.body, headers=probe.headers) as response:
            text = await response.text()
            try:
                return response.status, json.loads(text)
            except ValueError:
                return response.status, None
    except aiohttp.ClientError:
        return 0, None


async def _run_beside(session, endpoints: Endpoints, probe: Probe, victim: Probe) -> tuple[int, float, str | None]:
    request = asyncio.create_task(send(session, endpoints, probe))
    started = time.perf_counter()
    victim_status, body = await send(session, endpoints, victim)
    victim_s = time.perf_counter() - started
    status, _ = await request
    text = body["choices"][0]["text"] if victim_status == 200 and body else None
    return status, victim_s, text


async def run_once(session, endpoints: Endpoints, probe: Probe, victim: Probe, cleanup: tuple[Probe, ...],
                   interval_s: float) -> RunResult:
    with HealthPoller(endpoints.url, interval_s) as poller:
        status, victim_s, text = await _run_beside(session, endpoints, probe, victim)
    for extra in cleanup:
        await send(session, endpoints, extra)
    return RunResult(status, victim_s, text, tuple(poller.latencies), poller.num_errors)


async def victim_alone(session, endpoints: Endpoints, victim: Probe) -> str | None:
    status, body = await send(session, endpoints, victim)
    return body["choices"][0]["text"] if status == 200 and body else None


async def measure_class(session, endpoints: Endpoints, hostile: list[HostileClass], victim: Probe,
                        expected: str | None, interval_s: float) -> ClassResult:
    """One plain run, then one hostile run, per built class (one per repeat), after an untimed plain run (the
    class's first request of its shape may compile or allocate what later ones reuse)."""
    result = ClassResult(hostile[0].name)
    await run_once(session, endpoints, hostile[0].plain, victim, hostile[0].cleanup, interval_s)
    for built in hostile:
        plain = await run_once(session, endpoints, built.plain, victim, built.cleanup, interval_s)
        bad = await run_once(session, endpoints, built.hostile, victim, built.cleanup, interval_s)
        result.plain_victim_s.append(plain.victim_s)
        result.hostile_victim_s.append(bad.victim_s)
        result.statuses.append(bad.status)
        result.health_s += bad.health_s
        result.num_health_errors += bad.num_health_errors
        result.is_victim_equal &= bad.victim_text is not None and bad.victim_text == expected
    return result
