"""Operator test material for the pure decision tests: a pool, adapters, engine pods and what one pass read."""
from __future__ import annotations

from kubelora.operator import names
from kubelora.operator.decide import PoolView
from kubelora.operator.observe import Observation
from kubelora.operator.plan import ObservedAdapter
from kubelora.operator.specs import PoolSpec
from kubelora.operator.status import Failure

NS = "ns"
POOL_BODY = {"metadata": {"name": "p", "namespace": NS, "uid": "uid-p", "generation": 1},
             "spec": {"model": {"path": "/models/base"}, "adapterRoots": ["/adapters"],
                      "adapterUrlHosts": ["models.example"],
                      "engine": {"maxLoraRank": 8, "maxLoras": 2, "maxCpuLoras": 4}}}
POOL = PoolSpec.from_body(POOL_BODY)
REFUSED = Failure("AdapterRankTooLarge", "pod e0: r: rank 16 exceeds max_lora_rank 8")


def backoff_s(num_failures: int) -> float:
    return 10.0 * num_failures


def adapter(name: str, path: str | None = None, *, replicas=1, status=None, **spec) -> dict:
    body = {"apiVersion": "kubelora.io/v1alpha1", "kind": "LoRAAdapter",
            "metadata": {"name": name, "namespace": NS, "generation": 1},
            "spec": {"pool": "p", "source": {"path": path or f"/adapters/{name}"}, "replicas": replicas, **spec}}
    if status is not None:
        body["status"] = status
    return body


def pod(name: str, fingerprint: str = POOL.fingerprint) -> dict:
    return {"metadata": {"name": name, "annotations": {names.ANNOTATION_POOL_SPEC: fingerprint}},
            "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}


def observation(held: dict[str, dict[str, ObservedAdapter]], *, stale=()) -> Observation:
    pods = [pod(p, "old" if p in stale else POOL.fingerprint) for p in held]
    urls = {p: f"http://{p}" for p in held}
    return Observation(pods=pods, urls=urls, adapters=held, all_urls=dict(urls))


def view(*bodies: dict, held=None, tokens=None, stale=(), stored=None) -> PoolView:
    held = {"e0": {}, "e1": {}} if held is None else held
    return PoolView(POOL_BODY, POOL, {b["metadata"]["name"]: b for b in bodies}, tokens or {},
                    observation(held, stale=stale), stored)


def card(name: str, source: str, residency: str = "host") -> ObservedAdapter:
    return ObservedAdapter(name, source, None, "c0ffee", residency)
