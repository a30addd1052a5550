"""What a pool's pods report: engine IPs, readiness (API server) and adapters (`GET /v1/models`); routers the
placement revision they route on (`GET /placement`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import aiohttp

from kubelora.operator import names
from kubelora.operator.engine_client import EngineClient, EngineError
from kubelora.operator.kube import Kube
from kubelora.operator.plan import ObservedAdapter

log = logging.getLogger("kubelora.operator")


def is_pod_ready(pod: dict) -> bool:
    if pod["metadata"].get("deletionTimestamp") or not (pod.get("status") or {}).get("podIP"):
        return False
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def is_engine_serving(pod: dict) -> bool:
    """Whether to ask an engine pod what it holds (and so, if it answers, publish it ready): Ready, or not Ready
    only by the node-lifecycle controller's word. That controller marks the pods of a node whose heartbeats
    lapsed (an API-server outage is enough) Ready=False and leaves ContainersReady as the kubelet wrote it; the
    kubelet, which sets both together, writes Ready back once it lists the pod again. Engine pods have no
    readiness gates, so Ready=False with ContainersReady=True means exactly that; the operator's own
    `GET /v1/models` then tells whether the engine really answers."""
    if is_pod_ready(pod):
        return True
    if pod["metadata"].get("deletionTimestamp") or not (pod.get("status") or {}).get("podIP"):
        return False
    conditions = {c.get("type"): c.get("status") for c in (pod.get("status") or {}).get("conditions") or []}
    return conditions.get("Ready") == "False" and conditions.get("ContainersReady") == "True"


def pod_url(pod: dict) -> str:
    """The engine pod's serving port (what status shows, what clients and routers use)."""
    return f"http://{pod['status']['podIP']}:{names.ENGINE_PORT}"


def pod_admin_url(pod: dict) -> str:
    """The engine pod's admin port: every call the operator makes (list, long poll, load, unload)."""
    return f"http://{pod['status']['podIP']}:{names.ENGINE_ADMIN_PORT}"


@dataclass
class Observation:
    pods: list[dict]  # engine pods not being deleted
    urls: dict[str, str] = field(default_factory=dict)  # ready pods that answered GET /v1/models: admin URLs
    adapters: dict[str, dict[str, ObservedAdapter]] = field(default_factory=dict)
    all_urls: dict[str, str] = field(default_factory=dict)  # every pod with an IP, ready or not
    budgets: dict[str, int] = field(default_factory=dict)  # observed pod -> device adapter pool bytes
    key_fingerprints: dict[str, str | None] = field(default_factory=dict)  # observed pod -> its API key table's
    # Ready pods (per Kubernetes) whose engine refused the operator's token (401): they serve, but what they hold
    # cannot be read (a token rotation this operator did not see start, say after a restart)
    unauthorized: frozenset[str] = frozenset()


async def observe_pool(kube: Kube, client_for: Callable[[dict], EngineClient], namespace: str,
                       pool: str) -> Observation:
    """Every engine pod of the pool; the ready ones asked for their adapters, each with the client `client_for`
    gives for it (its admin token: tokens.py). Unreachable ones are skipped."""
    selector = names.selector_string(names.engine_selector(pool))
    pods = [p for p in await kube.list_pods(namespace, selector) if not p["metadata"].get("deletionTimestamp")]
    observation = Observation(pods=pods, all_urls={p["metadata"]["name"]: pod_url(p) for p in pods
                                                   if (p.get("status") or {}).get("podIP")})
    ready = [p for p in pods if is_engine_serving(p)]
    results = await asyncio.gather(*(client_for(p).list_models(pod_admin_url(p)) for p in ready),
                                   return_exceptions=True)
    unauthorized = set()
    for pod, result in zip(ready, results):
        name = pod["metadata"]["name"]
        if isinstance(result, EngineError):
            log.info("pool %s/%s: pod %s not observed: %s", namespace, pool, name, result)
            if result.status == 401:
                unauthorized.add(name)
            continue
        if isinstance(result, BaseException):
            raise result
        observation.urls[name] = pod_admin_url(pod)
        observation.adapters[name] = result.adapters
        observation.key_fingerprints[name] = result.api_keys_fingerprint
        if result.budget is not None:
            observation.budgets[name] = result.budget
    observation.unauthorized = frozenset(unauthorized)
    return observation


ROUTER_ACK_TIMEOUT_S = 2.0  # one router's GET /placement beyond its wait


@dataclass(frozen=True)
class RouterAck:
    """What one router pod says about the placement it routes on (`GET /placement`, docs/router.md)."""
    pod: str
    ip: str
    is_ready: bool  # the pod's Ready condition: it is in the pool Service's endpoints
    revision: int | None = None  # None: it did not answer; -1: it has no placement yet
    age_s: float | None = None  # since its last successful placement read
    loaded_at: float | None = None  # time.time() it took `revision`
    error: str | None = None  # why it did not answer, or its last placement read error
    # model -> HTTP status -> requests it refused on their API key since it started (api_keys.refusal_events)
    key_refusals: dict[str, dict[str, int]] = field(default_factory=dict)


def router_url(ip: str) -> str:
    return f"http://{ip}:{names.ROUTER_PORT}"


async def observe_routers(kube: Kube, session: aiohttp.ClientSession, namespace: str, pool: str, revision: int,
                          wait_s: float, behind: Collection[str] = (), behind_wait_s: float = 0.0
                          ) -> dict[str, RouterAck]:
    """Every router pod of the pool with an IP, asked for the revision it routes on. Each is asked to read its
    placement now and answer once it has `revision` (or its read fails), or after `wait_s`: the pass that
    published it sees it taken, instead of waiting out the router's poll. Pods in `behind` (behind in the last
    pass) get `behind_wait_s`, so a router that cannot read does not slow every pass down."""
    pods = [p for p in await kube.list_pods(namespace, names.selector_string(names.router_selector(pool)))
            if not p["metadata"].get("deletionTimestamp") and (p.get("status") or {}).get("podIP")]
    acks = await asyncio.gather(*(_ask_router(session, p, revision,
                                              behind_wait_s if p["metadata"]["name"] in behind else wait_s)
                                  for p in pods))
    return {ack.pod: ack for ack in acks}


async def _ask_router(session: aiohttp.ClientSession, pod: dict, revision: int, wait_s: float) -> RouterAck:
    name, ip, is_ready = pod["metadata"]["name"], pod["status"]["podIP"], is_pod_ready(pod)
    params = {"min_revision": str(revision), "wait": f"{wait_s:g}"}
    try:
        async with session.get(router_url(ip) + "/placement", params=params,
                               timeout=aiohttp.ClientTimeout(total=wait_s + ROUTER_ACK_TIMEOUT_S)) as response:
            if response.status != 200:
                return RouterAck(name, ip, is_ready, error=f"GET /placement: HTTP {response.status}")
            body = await response.json()
        refusals = body.get("keyRefusals") if isinstance(body.get("keyRefusals"), dict) else {}
        return RouterAck(name, ip, is_ready, revision=int(body["revision"]), age_s=float(body["ageSeconds"]),
                         loaded_at=body.get("loadedAt"), error=body.get("lastError"),
                         key_refusals={str(m): {str(k): int(v) for k, v in by_status.items()}
                                       for m, by_status in refusals.items() if isinstance(by_status, dict)})
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError) as exc:
        return RouterAck(name, ip, is_ready, error=f"GET /placement: {type(exc).__name__}: {exc}")
