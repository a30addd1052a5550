"""What one reconcile pass's reading and deciding cost at the fleet's size, timed in the bench's own process with
the operator's own functions, on the steady fleet while the operator idles between resyncs.

A whole pass (operator/reconcile.py) lists the pool's adapters, asks every ready pod for its full model list
(`observe_pool`: one `GET /v1/models` each, every adapter's card), and decides (`decide.plan_pass`: classify,
place, plan the calls) before it calls, publishes and writes status. These three parts are timed here, each the
fastest of a few rounds, so the report can say how much of a measured pass they are; and so is the deciding of a
pass for one changed adapter (`plan_pass` with a `decide.Change`: one adapter classified, the pool placed, that
adapter's calls planned), which reads nothing but that adapter's object. The JSON of one pod's model list is
parsed apart as well: a whole pass parses one per pod.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp

from kubelora.bench.operator_setup import adapter_body
from kubelora.operator import names
from kubelora.operator.decide import Change, PoolView, StoredPlacement, plan_pass
from kubelora.operator.engine_client import EngineClient
from kubelora.operator.kube import Kube
from kubelora.operator.memory import ReconcileMemory
from kubelora.operator.observe import observe_pool, pod_admin_url
from kubelora.operator.specs import PoolSpec

NUM_ROUNDS = 3
NEW_ADAPTER = "anatomy-new"  # decided for, never created


@dataclass(frozen=True)
class PassAnatomy:
    list_adapters_s: float  # GET of the pool's LoRAAdapters (with their statuses) and its JSON
    observe_s: float  # every ready pod's GET /v1/models, concurrently, and the cards parsed
    plan_s: float  # decide.plan_pass
    plan_change_s: float  # decide.plan_pass for one new adapter, against the whole plan (decide.Change)
    model_list_bytes: int  # one pod's model list
    model_list_parse_s: float  # json.loads of it
    num_adapters: int
    num_pods: int


async def _fastest(call, rounds: int = NUM_ROUNDS):
    """(the fastest round's seconds, the last round's result)."""
    best, result = float("inf"), None
    for _ in range(rounds):
        started = time.perf_counter()
        result = await call()
        best = min(best, time.perf_counter() - started)
    return best, result


async def time_pass(kube: Kube, session: aiohttp.ClientSession, namespace: str, pool: str,
                    admin_token: str) -> PassAnatomy:
    body = await kube.get_custom(names.POOL_PLURAL, namespace, pool)
    spec = PoolSpec.from_body(body)
    client = EngineClient(session, admin_token, 60.0)

    async def list_adapters() -> dict:
        return {a["metadata"]["name"]: a for a in await kube.list_custom(names.ADAPTER_PLURAL, namespace)
                if (a.get("spec") or {}).get("pool") == pool}

    list_s, bodies = await _fastest(list_adapters)
    observe_s, observation = await _fastest(lambda: observe_pool(kube, lambda _: client, namespace, pool))
    stored = StoredPlacement.from_configmap(await kube.get("ConfigMap", namespace,
                                                           names.placement_configmap_name(pool)))
    view = PoolView(body, spec, bodies, {}, observation, stored)

    async def plan():
        return plan_pass(view, ReconcileMemory(), time.time())

    plan_s, (whole, memory) = await _fastest(plan)
    new = adapter_body(NEW_ADAPTER, Path(spec.adapter_roots[0]), 1)
    new["metadata"].update(namespace=namespace, generation=1)
    changed = replace(view, bodies={**bodies, NEW_ADAPTER: new})

    async def plan_change():
        return plan_pass(changed, memory, time.time(), Change(whole, frozenset({NEW_ADAPTER})))

    plan_change_s, _ = await _fastest(plan_change)
    pod = next(p for p in observation.pods if p["metadata"]["name"] in observation.urls)
    headers = {"Authorization": f"Bearer {admin_token}"}
    async with session.get(f"{pod_admin_url(pod)}/v1/models", headers=headers) as response:
        text = await response.read()

    async def parse():
        return json.loads(text)

    parse_s, _ = await _fastest(parse)
    return PassAnatomy(list_s, observe_s, plan_s, plan_change_s, len(text), parse_s, len(bodies),
                       len(observation.urls))
