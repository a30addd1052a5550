"""Leader election of operator replicas over a coordination.k8s.io/v1 Lease.

The algorithm is client-go's, as the `kubernetes` package implements it (`kubernetes.leaderelection`, a thread
that acquires the Lease and renews it every `retry_period_s`): a replica whose renewals fail for
`renew_deadline_s` stops leading; a standby takes the Lease once `lease_duration_s` passed without a renewal
it observed. kopf's own peering does not fit replicas of one Deployment (peers of equal priority freeze each
other), so only the leader runs kopf at all (cli.py): a standby has no watches, no handlers, no writes.

What this module adds to the library: request timeouts (a hung API call must not keep a leader that cannot
renew), a watchdog that stops leading when renewals lapse even if the library's thread is stuck, and a
release on shutdown (client-go's ReleaseOnCancel: an empty holder, so a standby takes over at its next retry).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import signal
import threading
import time
from dataclasses import dataclass

import urllib3
from kubernetes import client
from kubernetes.client.rest import ApiException
from kubernetes.leaderelection import electionconfig, leaderelection
from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock

log = logging.getLogger("kubelora.operator.leader")


@dataclass(frozen=True)
class ElectionSettings:
    """client-go's defaults (15 s / 10 s / 2 s) scaled by 2/3, so that a standby takes over within
    lease + 2 retries = 12 s of a leader's death; a leader that cannot renew stops 4 s before that."""

    lease_name: str
    namespace: str
    identity: str
    lease_duration_s: int = 10  # Lease.spec.leaseDurationSeconds is an integer
    renew_deadline_s: float = 6.0
    retry_period_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("lease_name", "namespace", "identity"):
            if not getattr(self, name):
                raise ValueError(f"leader election needs a non-empty {name}")
        if self.retry_period_s < 1:  # the library refuses shorter periods
            raise ValueError(f"retry_period_s must be >= 1, got {self.retry_period_s}")
        if self.renew_deadline_s <= 1.2 * self.retry_period_s:  # the library's jitter factor
            raise ValueError(f"renew_deadline_s must be > 1.2 * retry_period_s, got {self.renew_deadline_s}")
        if int(self.lease_duration_s) != self.lease_duration_s or self.lease_duration_s <= self.renew_deadline_s:
            raise ValueError(f"lease_duration_s must be a whole number of seconds > renew_deadline_s, "
                             f"got {self.lease_duration_s}")


class _TimedLeaseApi:
    """The three calls LeaseLock makes, each with a request timeout (the generated client has none), and with
    connection failures raised as ApiException: LeaseLock handles only that, and anything else would end the
    library's thread for good (a standby that no longer stands by, after one API-server restart)."""

    def __init__(self, api: client.CoordinationV1Api, timeout_s: float) -> None:
        self._api, self._timeout = api, timeout_s

    def _call(self, method, *args, **kwargs):
        try:
            return method(*args, **kwargs, _request_timeout=self._timeout)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise ApiException(status=0, reason=f"{type(exc).__name__}: {exc}") from exc

    def read_namespaced_lease(self, name, namespace):
        return self._call(self._api.read_namespaced_lease, name, namespace)

    def create_namespaced_lease(self, namespace, body):
        return self._call(self._api.create_namespaced_lease, namespace, body)

    def replace_namespaced_lease(self, name, namespace, body):
        return self._call(self._api.replace_namespaced_lease, name=name, namespace=namespace, body=body)


class GuardedLeaseLock(LeaseLock):
    """LeaseLock that records its last successful renewal and, once released, writes nothing more."""

    def __init__(self, settings: ElectionSettings, api_client: client.ApiClient) -> None:
        super().__init__(settings.lease_name, settings.namespace, settings.identity)
        self.api_instance = _TimedLeaseApi(client.CoordinationV1Api(api_client), settings.retry_period_s)
        self._guard = threading.Lock()
        self.is_released = False
        self.renewed_at: float | None = None  # time.monotonic() of the last write that made us the holder

    def create(self, name, namespace, election_record):
        with self._guard:
            if self.is_released or not super().create(name, namespace, election_record):
                return False
            self.renewed_at = time.monotonic()
            return True

    def update(self, name, namespace, updated_record):
        with self._guard:
            if self.is_released or not super().update(name, namespace, updated_record):
                return False
            if updated_record.holder_identity == self.identity:
                self.renewed_at = time.monotonic()
            return True

    def release(self) -> bool:
        """Stop renewing; if the Lease is still ours, empty its holder (as client-go does on release). True when
        it was ours and is released."""
        with self._guard:
            self.is_released = True
            try:
                lease = self.api_instance.read_namespaced_lease(self.name, self.namespace)
            except ApiException:
                return False
            if lease.spec is None or lease.spec.holder_identity != self.identity:
                return False
            now = dt.datetime.now(dt.timezone.utc)
            lease.spec.holder_identity = None
            lease.spec.lease_duration_seconds = 1
            lease.spec.acquire_time = lease.spec.renew_time = now
            try:  # replace carries the resourceVersion read: a standby's write in between wins
                self.api_instance.replace_namespaced_lease(self.name, self.namespace, lease)
            except ApiException as exc:
                log.warning("releasing Lease %s/%s failed: %s", self.namespace, self.name, exc.reason)
                return False
            return True


class LeaderElector:
    """Runs the library's election in a daemon thread; `leading` is set once this replica holds the Lease, `lost`
    once it held it and could not renew it (then the process must stop acting: cli.py exits)."""

    def __init__(self, settings: ElectionSettings, api_client: client.ApiClient) -> None:
        self.settings = settings
        self.lock = GuardedLeaseLock(settings, api_client)
        self.leading = asyncio.Event()
        self.lost = asyncio.Event()
        self._watchdog: asyncio.Task | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()

        def setter(event: asyncio.Event):
            def set_it() -> None:
                try:
                    loop.call_soon_threadsafe(event.set)
                except RuntimeError:  # the loop is closed: the process is exiting anyway
                    pass
            return set_it

        config = electionconfig.Config(self.lock, lease_duration=int(self.settings.lease_duration_s),
                                       renew_deadline=self.settings.renew_deadline_s,
                                       retry_period=self.settings.retry_period_s,
                                       onstarted_leading=setter(self.leading), onstopped_leading=setter(self.lost))
        threading.Thread(target=leaderelection.LeaderElection(config).run, name="leader-election",
                         daemon=True).start()
        self._watchdog = loop.create_task(self._watch_renewals(), name="leader-election watchdog")

    async def _watch_renewals(self) -> None:
        """Stop leading when no renewal succeeded for renew_deadline_s, whatever the library's thread does."""
        await self.leading.wait()
        while not self.lost.is_set():
            await asyncio.sleep(self.settings.retry_period_s / 2)
            renewed_at = self.lock.renewed_at
            if renewed_at is None or time.monotonic() - renewed_at > self.settings.renew_deadline_s:
                log.error("Lease %s/%s not renewed for %.1fs: stepping down", self.settings.namespace,
                          self.settings.lease_name, self.settings.renew_deadline_s)
                self.lost.set()

    def holder(self) -> str | None:
        """Who holds the Lease now, as last read (None before the first read or when nobody does)."""
        lease = self.lock.lease_reference
        return None if lease is None or lease.spec is None else lease.spec.holder_identity

    @property
    def is_released(self) -> bool:
        return self.lock.is_released

    async def release(self) -> bool:
        if self._watchdog is not None:
            self._watchdog.cancel()
        return await asyncio.to_thread(self.lock.release)


SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def load_api_client() -> client.ApiClient:
    """In-cluster credentials first, then the kubeconfig (as kube.load_connection and kopf's login do)."""
    from kubernetes import config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient(client.Configuration.get_default_copy())


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
