"""What the operator benchmark writes to and reads from its API server: the namespace, the pool, the adapters, the
engine and router pods that a ReplicaSet and a kubelet would make, and a watch that stamps every adapter event
with this process's clock on arrival.

Pods: the bench's control plane has no controller-manager and no kubelet. So the bench creates each pod from its
Deployment's pod template (labels, annotations, spec), as a ReplicaSet would, and writes its status as a kubelet
would once the container answers: Running, Ready, its IP a loopback address where a fake engine or a router
listens (operator_fleet.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import quote

import aiohttp

from kubelora.operator import names
from kubelora.operator.kube import CUSTOM_PREFIX, Kube, KubeConnection, micro_time_now

NODE_NAME = "kubelora-bench"  # pods are bound to it; no Node object exists, nothing checks
WATCH_TIMEOUT_S = 300  # the API server ends a watch after this; the next one resumes from the last resourceVersion


def adapters_path(namespace: str) -> str:
    return f"{CUSTOM_PREFIX}/namespaces/{namespace}/{names.ADAPTER_PLURAL}"


async def create_namespace(kube: Kube, namespace: str) -> None:
    """The namespace and its `default` ServiceAccount, which admission wants for every pod (a controller-manager
    would make it)."""
    await kube.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                      "metadata": {"name": namespace}})
    await kube.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts",
                       {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}})


async def create_pool(kube: Kube, namespace: str, body: dict) -> None:
    await kube.request("POST", f"{CUSTOM_PREFIX}/namespaces/{namespace}/{names.POOL_PLURAL}", body)


async def get_pool(kube: Kube, namespace: str, name: str) -> dict | None:
    return await kube.get_custom(names.POOL_PLURAL, namespace, name)


async def create_adapters(kube: Kube, namespace: str, bodies: Iterable[dict], concurrency: int) -> dict[str, float]:
    """Create every adapter, `concurrency` requests in flight; returns name -> time.monotonic() just before its
    request was sent."""
    return await _each(bodies, concurrency,
                       lambda body: kube.request("POST", adapters_path(namespace), body),
                       lambda body: body["metadata"]["name"])


async def delete_adapters(kube: Kube, namespace: str, adapter_names: Iterable[str],
                          concurrency: int) -> dict[str, float]:
    return await _each(adapter_names, concurrency,
                       lambda name: kube.request("DELETE", f"{adapters_path(namespace)}/{quote(name)}"),
                       lambda name: name)


async def _each(items: Iterable, concurrency: int, call: Callable, name_of: Callable) -> dict[str, float]:
    limit = asyncio.Semaphore(concurrency)
    sent: dict[str, float] = {}

    async def one(item) -> None:
        async with limit:
            sent[name_of(item)] = time.monotonic()
            await call(item)

    await asyncio.gather(*(one(item) for item in items))
    return sent


async def wait_for_object(kube: Kube, kind: str, namespace: str, name: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while (found := await kube.get(kind, namespace, name)) is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{kind} {namespace}/{name} did not appear within {timeout_s:g} s "
                               "(is the operator running? see its log)")
        await asyncio.sleep(0.2)
    return found


async def make_pods(kube: Kube, namespace: str, deployment: dict, num_pods: int) -> list[str]:
    """`num_pods` pods from the Deployment's template, as its ReplicaSet would make them; their names."""
    template = deployment["spec"]["template"]
    base = deployment["metadata"]["name"]
    pod_names = [f"{base}-{i:02d}" for i in range(num_pods)]
    for name in pod_names:
        meta = {"name": name, "labels": dict(template["metadata"].get("labels") or {}),
                "annotations": dict(template["metadata"].get("annotations") or {})}
        body = {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
                "spec": {**template["spec"], "nodeName": NODE_NAME}}
        await kube.request("POST", f"/api/v1/namespaces/{namespace}/pods", body)
    return pod_names


async def mark_ready(kube: Kube, namespace: str, pod: str, ip: str, containers: list[dict]) -> None:
    """The status a kubelet writes once the pod's container runs and its readiness probe passes."""
    now = micro_time_now()[:19] + "Z"  # conditions take seconds
    conditions = [{"type": kind, "status": "True", "lastTransitionTime": now}
                  for kind in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]
    statuses = [{"name": c["name"], "image": c.get("image", ""), "imageID": "", "ready": True, "started": True,
                 "restartCount": 0, "state": {"running": {"startedAt": now}}} for c in containers]
    status = {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": "127.0.0.1",
              "hostIPs": [{"ip": "127.0.0.1"}], "startTime": now, "conditions": conditions,
              "containerStatuses": statuses}
    await kube.request("PATCH", f"/api/v1/namespaces/{namespace}/pods/{pod}/status", {"status": status},
                       content_type="application/merge-patch+json")


def is_ready(body: dict) -> bool:
    """The adapter's status says Ready for its current spec (kubectl wait's reading)."""
    status = body.get("status") or {}
    if status.get("observedGeneration") != body["metadata"].get("generation"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" and
               c.get("observedGeneration", status.get("observedGeneration")) == body["metadata"].get("generation")
               for c in status.get("conditions") or ())


@dataclass
class AdapterWatch:
    """A watch on the namespace's LoRAAdapters: when (time.monotonic(), on arrival) each adapter was first seen
    Ready, and when it was deleted. The status's own times have one-second resolution; these do not."""
    namespace: str
    ready_at: dict[str, float] = field(default_factory=dict)
    deleted_at: dict[str, float] = field(default_factory=dict)
    phases: dict[str, str] = field(default_factory=dict)  # the last phase seen of every adapter not deleted
    num_events: int = 0
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def see(self, kind: str, body: dict, now: float) -> None:
        name = body["metadata"]["name"]
        self.num_events += 1
        if kind == "DELETED":
            self.deleted_at.setdefault(name, now)
            self.phases.pop(name, None)
        else:
            self.phases[name] = (body.get("status") or {}).get("phase", "")
            if is_ready(body):
                self.ready_at.setdefault(name, now)
        self._changed.set()

    async def run(self, session: aiohttp.ClientSession, connection: KubeConnection) -> None:
        """Until cancelled: list, then watch from the list's resourceVersion (listing again when it expired)."""
        url = connection.server + adapters_path(self.namespace)
        version = None
        while True:
            if version is None:
                version = await self._list(session, connection, url)
            params = {"watch": "1", "resourceVersion": version, "allowWatchBookmarks": "true",
                      "timeoutSeconds": str(WATCH_TIMEOUT_S)}
            async with session.get(url, params=params, ssl=connection.ssl_context, headers=connection.headers,
                                   timeout=aiohttp.ClientTimeout(total=None, sock_read=WATCH_TIMEOUT_S + 60)) as resp:
                resp.raise_for_status()
                async for line in resp.content:
                    now = time.monotonic()
                    event = json.loads(line)
                    body = event["object"]
                    if event["type"] == "ERROR":  # 410 Gone: the version is too old, list again
                        version = None
                        break
                    version = body["metadata"]["resourceVersion"]
                    if event["type"] != "BOOKMARK":
                        self.see(event["type"], body, now)

    async def _list(self, session: aiohttp.ClientSession, connection: KubeConnection, url: str) -> str:
        async with session.get(url, ssl=connection.ssl_context, headers=connection.headers) as resp:
            resp.raise_for_status()
            listed = await resp.json()
        now = time.monotonic()
        for body in listed.get("items") or ():
            self.see("ADDED", body, now)
        return listed["metadata"]["resourceVersion"]

    async def wait(self, is_done: Callable[[], bool], timeout_s: float, what: Callable[[], str]) -> None:
        """Until `is_done()`; RuntimeError naming `what()` after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not is_done():
            self._changed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"timed out after {timeout_s:g} s waiting for {what()}")
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=min(left, 1.0))
            except asyncio.TimeoutError:
                pass

    async def wait_ready(self, adapter_names: Iterable[str], timeout_s: float) -> None:
        wanted = set(adapter_names)
        await self.wait(lambda: wanted <= self.ready_at.keys(), timeout_s,
                        lambda: f"{len(wanted - self.ready_at.keys())} of {len(wanted)} adapters to turn Ready "
                                f"(phases now: {_phase_counts(self.phases, wanted - self.ready_at.keys())})")

    async def wait_deleted(self, adapter_names: Iterable[str], timeout_s: float) -> None:
        wanted = set(adapter_names)
        await self.wait(lambda: wanted <= self.deleted_at.keys(), timeout_s,
                        lambda: f"{len(wanted - self.deleted_at.keys())} of {len(wanted)} adapters to be deleted")


def _phase_counts(phases: dict[str, str], adapter_names: set[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name in adapter_names:
        phase = phases.get(name, "not seen")
        counts[phase] = counts.get(phase, 0) + 1
    return counts
