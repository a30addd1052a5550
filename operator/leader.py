"""Leader election of operator replicas over a coordination.k8s.io/v1 Lease: client-go's algorithm, on `Kube`.

Every `retry_period_s` a replica reads the Lease and writes itself in as holder when the Lease is free, released,
expired (no renewal observed for its `leaseDurationSeconds`) or already its own (a renewal). Each write carries
the resourceVersion just read, so of two replicas writing at once one gets a 409 and tries again next period. A
leader whose renewals fail for `renew_deadline_s` stops leading, before a standby can take an unrenewed Lease.
kopf's own peering does not fit replicas of one Deployment (peers of equal priority freeze each other), so only
the leader runs kopf at all (cli.py): a standby has no watches, no handlers, no writes. On shutdown the leader
empties the holder (client-go's ReleaseOnCancel), so a standby takes over at its next retry.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import aiohttp

from kubelora.operator.kube import Kube, KubeError, micro_time_now
from kubelora.operator.settings import ElectionSettings

log = logging.getLogger("kubelora.operator.leader")
# What one attempt may meet on the way to the API server; the next period tries again.
TRANSIENT_ERRORS = (KubeError, aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError)
LEASE_TYPE = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease"}


class LeaderElector:
    """`leading` is set once this replica holds the Lease, `lost` once it held it and could not renew it (then the
    process must stop acting: cli.py exits). `kube`'s request timeout should be at most `retry_period_s`."""

    def __init__(self, settings: ElectionSettings, kube: Kube) -> None:
        self.settings = settings
        self.leading = asyncio.Event()
        self.lost = asyncio.Event()
        self.is_released = False
        self._kube = kube
        self._task: asyncio.Task | None = None
        self._observed: dict | None = None  # the Lease's spec as last read or written
        self._observed_at = 0.0  # time.monotonic() when that spec last changed
        self._renewed_at = 0.0  # time.monotonic() of the last write that made this replica the holder

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="leader-election")

    async def _run(self) -> None:
        period = self.settings.retry_period_s
        while not await self._attempt(period):
            await asyncio.sleep(period)
        self.leading.set()
        while True:  # renew every period; stop once no renewal succeeded for renew_deadline_s
            await asyncio.sleep(min(period, self._time_to_deadline()))
            if self._time_to_deadline() <= 0:
                log.error("Lease %s/%s not renewed for %.1fs: stepping down", self.settings.namespace,
                          self.settings.lease_name, self.settings.renew_deadline_s)
                self.lost.set()
                return
            await self._attempt(min(period, self._time_to_deadline()))

    def _time_to_deadline(self) -> float:
        return self._renewed_at + self.settings.renew_deadline_s - time.monotonic()

    async def _attempt(self, timeout_s: float) -> bool:
        try:
            return await asyncio.wait_for(self._try_acquire_or_renew(), timeout_s)
        except TRANSIENT_ERRORS as exc:
            log.log(logging.WARNING if self.leading.is_set() else logging.DEBUG, "Lease %s/%s: %s: %s",
                    self.settings.namespace, self.settings.lease_name, type(exc).__name__, exc)
            return False
        except Exception:  # noqa: BLE001  (a bug: logged, and the election goes on rather than end unseen)
            log.exception("Lease %s/%s: attempt failed", self.settings.namespace, self.settings.lease_name)
            return False

    async def _try_acquire_or_renew(self) -> bool:
        s = self.settings
        lease = await self._kube.get("Lease", s.namespace, s.lease_name)
        if lease is None:
            spec = self._next_spec({})
            manifest = {**LEASE_TYPE, "metadata": {"name": s.lease_name, "namespace": s.namespace}, "spec": spec}
            return await self._kube.create(manifest) and self._took(spec)
        spec = lease.get("spec") or {}
        if spec != self._observed:
            self._observed, self._observed_at = spec, time.monotonic()
        holder = spec.get("holderIdentity")
        duration_s = spec.get("leaseDurationSeconds") or s.lease_duration_s
        if holder and holder != s.identity and time.monotonic() < self._observed_at + duration_s:
            return False  # held, and renewed within its duration as far as this replica saw
        spec = self._next_spec(spec)
        try:
            await self._kube.replace({**lease, **LEASE_TYPE, "spec": spec})
        except KubeError as exc:
            if exc.status == 409:  # another replica wrote since the read
                return False
            raise
        return self._took(spec)

    def _next_spec(self, spec: dict) -> dict:
        now, s = micro_time_now(), self.settings
        if spec.get("holderIdentity") == s.identity:  # a renewal keeps the acquire time
            return {**spec, "leaseDurationSeconds": s.lease_duration_s, "renewTime": now}
        return {**spec, "holderIdentity": s.identity, "leaseDurationSeconds": s.lease_duration_s, "acquireTime": now,
                "renewTime": now, "leaseTransitions": (spec.get("leaseTransitions") or 0) + 1}

    def _took(self, spec: dict) -> bool:
        self._observed, self._observed_at = spec, time.monotonic()
        self._renewed_at = self._observed_at
        return True

    async def release(self) -> bool:
        """Stop electing; if the Lease is still ours, empty its holder with a 1 s duration (as client-go does on
        release). True when it was ours and is released; False on every later call."""
        if self.is_released:
            return False
        self.is_released = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])  # no write of the election's is in flight after this
        s = self.settings
        try:
            lease = await self._kube.get("Lease", s.namespace, s.lease_name)
            spec = (lease or {}).get("spec") or {}
            if spec.get("holderIdentity") != s.identity:
                return False
            now = micro_time_now()
            spec = {**spec, "holderIdentity": None, "leaseDurationSeconds": 1, "acquireTime": now, "renewTime": now}
            # replace carries the resourceVersion read: a standby's write in between wins
            await self._kube.replace({**lease, **LEASE_TYPE, "spec": spec})
        except TRANSIENT_ERRORS as exc:
            log.warning("releasing Lease %s/%s failed: %s", s.namespace, s.lease_name, exc)
            return False
        return True


async def stand_by(elector: LeaderElector, liveness_port: int | None) -> bool:
    """Until this replica leads: answer the liveness/readiness probe (a standby is healthy) and stop on
    SIGTERM/SIGINT. True once leading; False when stopped first."""
    from aiohttp import web

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    runner = None
    if liveness_port:
        app = web.Application()
        async def healthz(_: web.Request) -> web.Response:
            return web.json_response({"leading": False})

        app.router.add_get("/healthz", healthz)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "0.0.0.0", liveness_port).start()
    log.info("standing by as %s for Lease %s/%s", elector.settings.identity, elector.settings.namespace,
             elector.settings.lease_name)
    waits = [asyncio.create_task(elector.leading.wait()), asyncio.create_task(stop.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waits:
            task.cancel()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        if runner is not None:
            await runner.cleanup()  # kopf's liveness endpoint takes the port over
    if stop.is_set():
        return False
    log.info("leading as %s (Lease %s/%s)", elector.settings.identity, elector.settings.namespace,
             elector.settings.lease_name)
    return True
