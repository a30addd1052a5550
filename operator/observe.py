"""What a pool's engine pods report: their IPs and readiness (API server) and adapters (`GET /v1/models`)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

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


def pod_url(pod: dict) -> str:
    return f"http://{pod['status']['podIP']}:{names.ENGINE_PORT}"


@dataclass
class Observation:
    pods: list[dict]  # engine pods not being deleted
    urls: dict[str, str] = field(default_factory=dict)  # ready pods that answered GET /v1/models
    adapters: dict[str, dict[str, ObservedAdapter]] = field(default_factory=dict)
    all_urls: dict[str, str] = field(default_factory=dict)  # every pod with an IP, ready or not
    budgets: dict[str, int] = field(default_factory=dict)  # observed pod -> device adapter pool bytes


async def observe_pool(kube: Kube, client: EngineClient, namespace: str, pool: str) -> Observation:
    """Every engine pod of the pool; the ready ones asked for their adapters (unreachable ones are skipped)."""
    selector = names.selector_string(names.engine_selector(pool))
    pods = [p for p in await kube.list_pods(namespace, selector) if not p["metadata"].get("deletionTimestamp")]
    observation = Observation(pods=pods, all_urls={p["metadata"]["name"]: pod_url(p) for p in pods
                                                   if (p.get("status") or {}).get("podIP")})
    ready = [p for p in pods if is_pod_ready(p)]
    results = await asyncio.gather(*(client.list_models(pod_url(p)) for p in ready), return_exceptions=True)
    for pod, result in zip(ready, results):
        name = pod["metadata"]["name"]
        if isinstance(result, EngineError):
            log.info("pool %s/%s: pod %s not observed: %s", namespace, pool, name, result)
            continue
        if isinstance(result, BaseException):
            raise result
        observation.urls[name] = pod_url(pod)
        observation.adapters[name], budget = result
        if budget is not None:
            observation.budgets[name] = budget
    return observation
