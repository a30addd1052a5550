"""Where placement comes from: the pool's ConfigMap through the Kubernetes API, or a file (tests, no cluster).

Both sources poll every `poll_interval` seconds and hand new text to `PlacementStore.update` only when it changed
(the ConfigMap's resourceVersion, the file's bytes). A read or parse failure keeps the last good placement:
routing on a slightly old placement is safe (the home replica loads on demand), routing on none is not.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Protocol

from kubelora.engine.common.logs import log_event
from kubelora.engine.router.placement import PLACEMENT_KEY, Placement, parse_placement

log = logging.getLogger("kubelora.engine.router")


class PlacementStore:
    """The placement the router routes on now; replaced whole, never mutated."""

    def __init__(self) -> None:
        self.placement: Placement | None = None
        self.loaded_at: float | None = None  # time.time() of the last accepted placement
        self.num_updates = 0
        self.num_errors = 0

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

    def fail(self, origin: str, error: str) -> None:
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
            await asyncio.sleep(self.poll_interval)

    def poll(self, store: PlacementStore) -> None:
        try:
            data = self.path.read_bytes()
        except OSError as exc:
            if str(exc) != self._last_error:  # log an outage once, not every poll
                store.fail(str(self.path), str(exc))
            self._last_error = str(exc)
            self._last = None
            return
        self._last_error = None
        if data != self._last:
            self._last = data
            store.update(data.decode("utf-8", errors="replace"), str(self.path))


class ConfigMapSource:
    """Polls one ConfigMap with `get` (the router's Role needs only get on that one name)."""

    def __init__(self, namespace: str, name: str, kubeconfig: str | None, poll_interval: float) -> None:
        self.namespace = namespace
        self.name = name
        self.kubeconfig = kubeconfig
        self.poll_interval = poll_interval
        self._resource_version: str | None = None
        self._last_error: str | None = None
        self._api = None

    async def run(self, store: PlacementStore) -> None:
        while True:
            await asyncio.to_thread(self.poll, store)
            await asyncio.sleep(self.poll_interval)

    def poll(self, store: PlacementStore) -> None:
        from kubernetes.client.exceptions import ApiException

        origin = f"configmap {self.namespace}/{self.name}"
        try:
            configmap = self._core_api().read_namespaced_config_map(self.name, self.namespace, _request_timeout=10)
        except ApiException as exc:
            self._report(store, origin, f"HTTP {exc.status} {exc.reason}")
            return
        except Exception as exc:  # connection refused, TLS, timeouts: keep the last placement, try again
            self._report(store, origin, f"{type(exc).__name__}: {exc}")
            return
        self._last_error = None
        version = configmap.metadata.resource_version
        if version == self._resource_version:
            return
        self._resource_version = version
        text = (configmap.data or {}).get(PLACEMENT_KEY)
        if text is None:
            store.fail(origin, f"no key {PLACEMENT_KEY!r}")
            return
        store.update(text, origin)

    def _report(self, store: PlacementStore, origin: str, error: str) -> None:
        if error != self._last_error:  # log an outage once, not every poll
            store.fail(origin, error)
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
