"""Clients of a live HTTP server on loopback for the engine's and the router's tests: JSON posts, raw-socket
exchanges (for requests no HTTP client would send), `/health` polled from another process, and the hostile
inputs of the HTTP edge that both servers must refuse alike."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zlib

SECRET = "sk-tenant-7f3a9c2e51d04b8a"
# Header lines aiohttp's parser refuses, each carrying SECRET (an API key where a tenant would put one).
MALFORMED_HEADERS = {
    "control character": f"Authorization: Bearer {SECRET}\x01tail\r\n".encode(),
    "NUL": f"Authorization: Bearer {SECRET}\x00\r\n".encode(),
    "over 8 KiB": f"Authorization: Bearer {SECRET}{'x' * 9000}\r\n".encode(),
    "other header": f"X-Api-Key: {SECRET}\x7f\x02\r\n".encode(),
    "bare LF in value": f"Authorization: Bearer {SECRET}\nX: y\r\n".encode(),
}


def free_port() -> int:
    """A loopback port free at the call (bound, then released): for a server to listen on, or, left unused, an
    address where nothing answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def gzip_bomb(inflated_bytes: int) -> bytes:
    """gzip of `inflated_bytes` zeros (about 1 KiB of output per MiB), built without holding them in memory."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    chunk = bytes(1 << 20)
    return b"".join(compressor.compress(chunk) for _ in range(inflated_bytes >> 20)) + compressor.flush()


def post(url: str, body: bytes, headers: dict | None = None, timeout_s: float = 120.0) -> tuple[int, bytes, float]:
    """(status, the answer's bytes, seconds) of a JSON POST; an HTTP error status is an answer, not a raise."""
    started = time.monotonic()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})},
                                     method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            status, payload = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, payload = exc.code, exc.read()
    return status, payload, time.monotonic() - started


def post_json(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict, float]:
    """`post`, its answer decoded from JSON."""
    status, payload, seconds = post(url, body, headers)
    return status, json.loads(payload), seconds


def raw_exchange(port: int, request: bytes, attempts: int = 3) -> bytes:
    """The bytes a loopback server at `port` answers to `request`, sent as is; b"" if every attempt was reset.

    A server closes the connection after a parser error; request bytes still unread then turn the close into a
    reset that may overtake the answer, so an empty answer is tried again. Blocking: an async test whose server
    runs on its own loop calls it through `asyncio.to_thread`."""
    for _ in range(attempts):
        chunks = []
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            try:
                sock.sendall(request)
                while chunk := sock.recv(65536):
                    chunks.append(chunk)
            except ConnectionError:
                pass
        if chunks:
            return b"".join(chunks)
    return b""


def split_answer(answer: bytes) -> tuple[int, dict[str, str], bytes]:
    """(status, headers with lower-case names, body) of a raw HTTP/1.x answer."""
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return int(status_line.split(" ", 2)[1]), headers, body


# Polls /health every argv[2] seconds until stdin closes, then prints every latency: in its own process, so that
# what it measures is the server, not the GIL of the process that also runs the test's clients.
_PROBE = """
import json, sys, threading, time, urllib.request
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
latencies = []
while not stop.is_set():
    started = time.monotonic()
    with urllib.request.urlopen(sys.argv[1] + "/health", timeout=60) as response:
        assert response.status == 200
    latencies.append(time.monotonic() - started)
    time.sleep(float(sys.argv[2]))
print(json.dumps(latencies))
"""


class HealthProbe:
    """`/health` polled from another process every `interval_s` while the block runs; `worst_s` is the slowest
    answer, of at least `min_probes`."""

    def __init__(self, url: str, interval_s: float = 0.01, min_probes: int = 5) -> None:
        self._url = url
        self._interval_s = interval_s
        self._min_probes = min_probes
        self.latencies: list[float] = []

    def __enter__(self) -> HealthProbe:
        self._process = subprocess.Popen([sys.executable, "-c", _PROBE, self._url, str(self._interval_s)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)  # the interpreter starts and the first probes go out
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(0.1)
        out, _ = self._process.communicate("", timeout=60)
        self.latencies = json.loads(out)

    @property
    def worst_s(self) -> float:
        assert len(self.latencies) >= self._min_probes, self.latencies
        return max(self.latencies)
