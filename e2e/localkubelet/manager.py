"""The sync loop: pods bound to this node become pod workers; deletions stop them."""
from __future__ import annotations

import logging
import threading

from .apiclient import ApiClient, ApiError, query
from .config import KubeletConfig
from .podworker import PodWorker, WorkerDeps

TERMINAL_PHASES = ("Succeeded", "Failed")
log = logging.getLogger(__name__)


class PodManager:
    """Lists this node's pods every sync period. Polling instead of a watch keeps the
    kubelet simple; one second is also the real kubelet's housekeeping cadence."""

    def __init__(self, cfg: KubeletConfig, deps: WorkerDeps) -> None:
        self._cfg = cfg
        self._deps = deps
        self._workers: dict[str, PodWorker] = {}
        self._lock = threading.Lock()

    @property
    def api(self) -> ApiClient:
        return self._deps.api

    def find_worker(self, namespace: str, name: str) -> PodWorker | None:
        with self._lock:
            return next((w for w in self._workers.values()
                         if w.key == f"{namespace}/{name}"), None)

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.sync_once()
            except (ApiError, OSError) as error:
                log.warning("pod sync failed: %s", error)
            stop.wait(self._cfg.sync_period_s)

    def sync_once(self) -> None:
        selector = f"spec.nodeName={self._cfg.node_name}"
        pods = self.api.get("/api/v1/pods" + query(fieldSelector=selector))["items"]
        listed = {pod["metadata"]["uid"]: pod for pod in pods}
        with self._lock:
            for uid, pod in listed.items():
                self._sync_pod(uid, pod)
            for uid, worker in list(self._workers.items()):
                if uid not in listed:
                    worker.request_stop(worker_grace(worker.pod), delete_from_api=False)
                if not worker.is_alive() and worker.ident is not None:
                    del self._workers[uid]

    def _sync_pod(self, uid: str, pod: dict) -> None:
        worker = self._workers.get(uid)
        is_deleting = pod["metadata"].get("deletionTimestamp") is not None
        if worker is None:
            if pod.get("status", {}).get("phase") in TERMINAL_PHASES and not is_deleting:
                return  # finished under an earlier kubelet; nothing to run
            worker = PodWorker(pod, self._deps)
            self._workers[uid] = worker
            worker.start()
        worker.pod = pod
        if is_deleting:
            worker.request_stop(worker_grace(pod), delete_from_api=True)

    def stop_all(self, max_grace_s: float) -> None:
        with self._lock:
            workers = list(self._workers.values())
        for worker in workers:
            worker.request_stop(min(max_grace_s, worker_grace(worker.pod)), delete_from_api=False)
        for worker in workers:
            worker.join(timeout=max_grace_s + 5)


def worker_grace(pod: dict) -> float:
    meta, spec = pod["metadata"], pod["spec"]
    grace = meta.get("deletionGracePeriodSeconds", spec.get("terminationGracePeriodSeconds", 30))
    return float(grace)
