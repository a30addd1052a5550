"""Where placement comes from: the pool's ConfigMap through the Kubernetes API, or a file (tests, no cluster).

Both sources poll every `poll_interval` seconds and hand new text to `PlacementStore.update` only when it changed
(the ConfigMap's resourceVersion, the file's bytes); `PlacementStore.nudge` cuts the pause short (the operator
asks for a revision it just published: `GET /placement?min_revision=N`). A read or parse failure keeps the last
good placement: routing on a slightly old placement is safe (the router retries another replica, which loads
the adapter on demand), routing on none is not. Every successful read, changed or not, confirms the placement
(`confirmed_at`): its age is how long the router has not been able to tell whether it is current.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Protocol

from kubelora.contract.logs import log_event
from kubelora.router.placement import PLACEMENT_KEY, Placement, parse_placement

log = logging.getLogger("kubelora.router")


MIN_READ_GAP_S = 0.05  # nudges cannot make a source read more often than this


class PlacementStore:
    """The placement the router routes on now; replaced whole, never mutated."""

    def __init__(self) -> None:
        self.placement: Placement | None = None
        self.loaded_at: float | None = None  # time.time() of the last accepted placement
        self.num_updates = 0
        self.num_errors = 0
        self.started_at = time.monotonic()
        self.confirmed_at: float | None = None  # time.monotonic() of the last successful read
        self.last_error: str | None = None  # the failure of the last read; None after a good one
        self._nudged = asyncio.Event()
        self._read_done = asyncio.Event()  # set and replaced after every read, good or bad

    def age_s(self) -> float:
        """Seconds since a read last confirmed the placement (since start while none has)."""
        return time.monotonic() - (self.confirmed_at if self.confirmed_at is not None else self.started_at)

    def nudge(self) -> None:
        """Read again now instead of after the poll interval."""
        self._nudged.set()

    async def pause(self, poll_interval: float) -> None:
        """A source's wait between reads: `poll_interval`, or less when nudged (never under MIN_READ_GAP_S)."""
        await asyncio.sleep(MIN_READ_GAP_S)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._nudged.wait(), timeout=max(poll_interval - MIN_READ_GAP_S, 0))
        self._nudged.clear()

    async def wait_read(self, timeout_s: float) -> bool:
        """Wait for the next read to finish; False after `timeout_s`."""
        try:
            await asyncio.wait_for(self._read_done.wait(), timeout=timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def _read_finished(self) -> None:
        self._read_done.set()
        self._read_done = asyncio.Event()

    def confirm(self) -> None:
        """A read succeeded (whether or not the placement changed)."""
        self.confirmed_at = time.monotonic()
        self.last_error = None
        self._read_finished()

    def set(self, placement: Placement) -> None:
        previous = self.placement
        self.placement = placement
        self.loaded_at = time.time()
        self.num_updates += 1
        log_event(log, "placement_updated", pool=placement.pool, revision=placement.revision,
                  previous_revision=previous.revision if previous else None,
                  num_ready=len(placement.ready_replicas()), num_replicas=len(placement.replicas),
                  num_adapters=len(placement.adapters))

    def update(self, text: str, origin: str) -> None:
        try:
            placement = parse_placement(text)
        except ValueError as exc:
            self.fail(origin, str(exc))
            return
        self.set(placement)
        self.confirm()

    def fail(self, origin: str, error: str, *, is_logged: bool = True) -> None:
        """A read or parse failed; `is_logged` False for the same failure again (an outage is logged once)."""
        self.last_error = f"{origin}: {error}"
        self._read_finished()
        if not is_logged:
            return
        self.num_errors += 1
        log_event(log, "placement_read_failed", logging.WARNING, origin=origin, error=error,
                  is_serving_previous=self.placement is not None)


class PlacementSource(Protocol):
    async def run(self, store: PlacementStore) -> None:
        """Poll until cancelled, handing changed placement text to `store.update`."""


class FileSource:
    def __init__(self, path: str, poll_interval: float) -> None:
        self.path = Path(path)
        self.poll_interval = poll_interval
        self._last: bytes | None = None
        self._last_error: str | None = None

    async def run(self, store: PlacementStore) -> None:
        while True:
            self.poll(store)
            await store.pause(self.poll_interval)

    def poll(self, store: PlacementStore) -> None:
        try:
            data = self.path.read_bytes()
        except OSError as exc:
            store.fail(str(self.path), str(exc), is_logged=str(exc) != self._last_error)
            self._last_error = str(exc)
            self._last = None
            return
        self._last_error = None
        if data != self._last:
            self._last = data
            store.update(data.decode("utf-8", errors="replace"), str(self.path))
        elif store.last_error is None:  # unchanged and good
            store.confirm()
        else:  # unchanged but it did not parse: still failing
            store.fail(str(self.path), store.last_error, is_logged=False)


class ConfigMapSource:
    """Polls one ConfigMap with `get` (the router's Role needs only get on that one name).

    The read runs in a thread (the kubernetes client blocks); its outcome is handed to the store on the loop."""

    def __init__(self, namespace: str, name: str, kubeconfig: str | None, poll_interval: float) -> None:
        self.namespace = namespace
        self.name = name
        self.kubeconfig = kubeconfig
        self.poll_interval = poll_interval
        self.origin = f"configmap {namespace}/{name}"
        self._resource_version: str | None = None
        self._is_bad = False  # the ConfigMap at _resource_version did not give a placement
        self._last_error: str | None = None
        self._api = None

    async def run(self, store: PlacementStore) -> None:
        while True:
            self.take(store, await asyncio.to_thread(self.read))
            await store.pause(self.poll_interval)

    def poll(self, store: PlacementStore) -> None:
        """One read and its outcome, in the caller's thread (tests)."""
        self.take(store, self.read())

    def read(self):
        """The ConfigMap, or the error text of a failed read (connection refused, TLS, timeouts, HTTP 403)."""
        from kubernetes.client.exceptions import ApiException

        try:
            return self._core_api().read_namespaced_config_map(self.name, self.namespace, _request_timeout=10)
        except ApiException as exc:
            return f"HTTP {exc.status} {exc.reason}"
        except Exception as exc:  # noqa: BLE001 - any failure keeps the last placement; the next poll tries again
            return f"{type(exc).__name__}: {exc}"

    def take(self, store: PlacementStore, configmap) -> None:
        if isinstance(configmap, str):
            self._report(store, configmap)
            return
        self._last_error = None
        version = configmap.metadata.resource_version
        if version == self._resource_version:
            if self._is_bad:
                store.fail(self.origin, store.last_error or "unusable", is_logged=False)
            else:
                store.confirm()
            return
        self._resource_version = version
        text = (configmap.data or {}).get(PLACEMENT_KEY)
        if text is None:
            self._is_bad = True
            store.fail(self.origin, f"no key {PLACEMENT_KEY!r}")
            return
        store.update(text, self.origin)
        self._is_bad = store.last_error is not None

    def _report(self, store: PlacementStore, error: str) -> None:
        store.fail(self.origin, error, is_logged=error != self._last_error)  # an outage is logged once, not every poll
        self._last_error = error

    def _core_api(self):
        if self._api is None:
            from kubernetes import client, config

            if self.kubeconfig:
                api_client = config.new_client_from_config(config_file=self.kubeconfig)
            else:
                configuration = client.Configuration()
                config.load_incluster_config(client_configuration=configuration)
                api_client = client.ApiClient(configuration)
            self._api = client.CoreV1Api(api_client)
        return self._api
