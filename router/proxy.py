"""Forwarding one OpenAI request to a replica: headers in, bytes out chunk by chunk, retries before any byte.

The answer is relayed as it arrives (`iter_any`), so SSE streams pass through unbuffered. A client that goes
away cancels the handler (the server runs with `handler_cancellation`); closing the upstream response then
drops the replica connection, and the engine aborts the request. A replica that cannot be reached (connect
error, reset before the answer's headers) is counted and the request goes to the next candidate, through every
ready replica of the placement if need be: on a stale placement (pods deleted since) the holders may all be
gone, and any other replica loads the adapter on demand. Replicas that failed to connect in the last
`UNREACHABLE_S` seconds are tried last, so a dead pod costs one connect timeout, not one per request. A replica
that breaks after the first byte ends an SSE stream with one `error` event and `[DONE]`.
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from kubelora.contract.errors import BadGateway
from kubelora.contract.http_errors import to_http
from kubelora.contract.logs import log_event
from kubelora.router.metrics import RouterMetrics
from kubelora.router.placement import Replica
from kubelora.router.routing import Route

log = logging.getLogger("kubelora.router")

# RFC 9110 hop-by-hop headers, and the ones aiohttp sets itself on each side.
_HOP_BY_HOP = frozenset(("connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                         "transfer-encoding", "upgrade", "host", "content-length", "date", "server"))
REPLICA_HEADER = "X-Kubelora-Replica"  # which pod answered: for debugging and tests
UNREACHABLE_S = 10.0  # a replica that failed to connect is tried after the others for this long


class InFlight:
    """Requests in flight per pod, as this router sees them (the bounded-load input)."""

    def __init__(self) -> None:
        self.counts: defaultdict[str, int] = defaultdict(int)

    def snapshot(self) -> dict[str, int]:
        return {pod: n for pod, n in self.counts.items() if n}


class Unreachable:
    """Replicas whose last connect failed, and when (time.monotonic())."""

    def __init__(self) -> None:
        self.failed_at: dict[str, float] = {}

    def order(self, candidates: tuple[Replica, ...], now: float) -> list[Replica]:
        """The candidates with the recently unreachable ones moved to the end (each group keeps its order)."""
        recent = {pod for pod, at in self.failed_at.items() if now - at < UNREACHABLE_S}
        return ([r for r in candidates if r.pod not in recent] + [r for r in candidates if r.pod in recent])

    def mark(self, pod: str, now: float) -> None:
        self.failed_at[pod] = now

    def clear(self, pod: str) -> None:
        self.failed_at.pop(pod, None)


async def forward(request: web.Request, body: bytes, route: Route, session: aiohttp.ClientSession,
                  in_flight: InFlight, metrics: RouterMetrics,
                  unreachable: Unreachable | None = None) -> web.StreamResponse:
    headers = _upstream_headers(request)
    unreachable = unreachable if unreachable is not None else Unreachable()
    attempts = unreachable.order(route.candidates, time.monotonic())
    for attempt, replica in enumerate(attempts):
        in_flight.counts[replica.pod] += 1
        try:
            try:
                upstream = await session.post(replica.url + request.path_qs, data=body, headers=headers)
            except aiohttp.ClientError as exc:  # nothing reached the client yet: the next replica may answer
                unreachable.mark(replica.pod, time.monotonic())
                metrics.upstream_errors.labels(replica.pod, "connect").inc()
                log_event(log, "replica_unreachable", logging.WARNING, pod=replica.pod, url=replica.url,
                          error=f"{type(exc).__name__}: {exc}", is_retried=attempt + 1 < len(attempts))
                if attempt + 1 < len(attempts):
                    metrics.retries.inc()
                    continue
                raise BadGateway(f"no replica of the pool could be reached (last: {replica.pod}: "
                                 f"{type(exc).__name__})") from None
            unreachable.clear(replica.pod)
            try:
                response = await _relay(request, upstream, replica, metrics)
            except BaseException:
                upstream.close()  # cancelled or the client went away: drop the connection, the engine aborts
                raise
            upstream.release()
            return response
        finally:
            in_flight.counts[replica.pod] -= 1
    raise AssertionError("route without candidates")  # routing.route never returns one


def _upstream_headers(request: web.Request) -> CIMultiDict[str]:
    headers = CIMultiDict((name, value) for name, value in request.headers.items() if name.lower() not in _HOP_BY_HOP)
    headers.setdefault("Accept-Encoding", "identity")  # relay bytes as the replica sends them
    forwarded = request.headers.get("X-Forwarded-For")
    peer = request.remote or ""
    headers["X-Forwarded-For"] = f"{forwarded}, {peer}" if forwarded else peer
    return headers


async def _relay(request: web.Request, upstream: aiohttp.ClientResponse, replica: Replica,
                 metrics: RouterMetrics) -> web.StreamResponse:
    response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
    for name, value in upstream.headers.items():
        if name.lower() not in _HOP_BY_HOP:
            response.headers.add(name, value)
    response.headers[REPLICA_HEADER] = replica.pod
    is_event_stream = upstream.content_type == "text/event-stream"
    if upstream.content_length is not None and not is_event_stream:  # a stream stays chunked: we may add an event
        response.content_length = upstream.content_length
    await response.prepare(request)
    while True:
        try:
            chunk = await upstream.content.readany()
        except aiohttp.ClientError as exc:  # the replica broke; a failed write to the client raises out instead
            return await _end_broken(request, response, replica, exc, is_event_stream, metrics)
        if not chunk:
            break
        await response.write(chunk)
    await response.write_eof()
    return response


async def _end_broken(request: web.Request, response: web.StreamResponse, replica: Replica, exc: Exception,
                      is_event_stream: bool, metrics: RouterMetrics) -> web.StreamResponse:
    metrics.upstream_errors.labels(replica.pod, "broken").inc()
    log_event(log, "replica_broke_answer", logging.WARNING, pod=replica.pod, error=f"{type(exc).__name__}: {exc}")
    if not is_event_stream:
        response.force_close()  # a truncated body: the client must see the connection end, not a short reply
        if request.transport is not None:
            request.transport.close()
        return response
    await response.write(_sse_error(replica.pod))
    await response.write_eof()
    return response


def _sse_error(pod: str) -> bytes:
    error = BadGateway(f"replica {pod} failed while streaming the answer", code="replica_broke_stream")
    return f"data: {json.dumps(to_http(error).body())}\n\ndata: [DONE]\n\n".encode()
