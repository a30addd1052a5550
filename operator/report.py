"""What one pass publishes and writes, pure: the placement payload, each adapter's status and the pool's status.

Two steps, because an adapter's status depends on whether the routers took the placement that lists it:
`build_publication` takes what the pass read, its plan, the results of its calls and the memory after them, and
gives the payload to publish; once it is published and the routers were asked (`observe.observe_routers`),
`report_publication` gives the statuses (`build_report` does both, for a pass that sees no routers). What a pod
holds after the pass is the observation with the successful calls applied (`held_after`); the observation
itself is left as it was read.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from kubelora.operator import names
from kubelora.operator.decide import AdapterSet, CallResult, Event, PassPlan, PoolView, freeze_new_failures
from kubelora.operator.memory import Published, ReconcileMemory
from kubelora.operator.observe import Observation
from kubelora.operator.placement import Placement
from kubelora.operator.plan import DesiredAdapter, ObservedAdapter, Unload, is_current
from kubelora.operator.routers import RouterView, judge_routers, unrouted
from kubelora.operator.specs import AdapterSpec, InvalidSpec
from kubelora.operator.status import (INSUFFICIENT_CAPACITY, POOL_NOT_FOUND, Failure, Phase, ReplicaState,
                                      ReplicaStatus, build_adapter_status, build_pool_status)

HeldByPod = Mapping[str, Mapping[str, ObservedAdapter]]  # pod -> adapter -> what the pod reports


@dataclass(frozen=True)
class Report:
    adapter_statuses: dict[str, dict]  # adapter (not being deleted, in the plan's scope) -> its new status
    pool_status: dict
    placement: dict | None  # the payload to publish, with its new revision; None: unchanged
    memory: ReconcileMemory  # to keep once the placement is published
    released: frozenset[str] = frozenset()  # adapters being deleted (in scope) that no observed pod holds any more
    next_pass_s: float | None = None  # run the next pass this soon (a router lags), not at the resync


@dataclass(frozen=True)
class Holdings:
    """What the pods hold after the pass's calls, with what the operator knows it loaded there."""
    held: HeldByPod
    memory: ReconcileMemory

    def holders(self, name: str, pods: Iterable[str], want: DesiredAdapter | None) -> list[str]:
        """Pods holding `name` resident (host or device), at `want`'s revision when given."""
        return [pod for pod in pods if self._serves(pod, name, want)]

    def replica(self, name: str, pod: str, want: DesiredAdapter | None) -> ReplicaStatus:
        have = self.held.get(pod, {}).get(name)
        retry = self.memory.retries.get((pod, name))
        error = retry.message if retry is not None else (have.last_error if have is not None else None)
        if self._serves(pod, name, want):
            served = self.memory.served.get((pod, name)) or (want.source_revision if want is not None else None)
            return ReplicaStatus(pod, ReplicaState.LOADED, revision=served, content_revision=have.content_revision,
                                 residency=have.residency, loaded_at=have.loaded_at, last_error=error)
        if retry is None:
            return ReplicaStatus(pod, ReplicaState.LOADING, last_error=error)
        return ReplicaStatus(pod, ReplicaState.PENDING, last_error=error, next_retry_at=retry.retry_at)

    def is_on_device(self, pod: str, name: str) -> bool:
        """Whether the pod's last answer had the adapter's copy in its device pool (the router's first tier; it
        moves with traffic, so this is the view of the pass that read it)."""
        have = self.held.get(pod, {}).get(name)
        return have is not None and have.residency == "device"

    def _serves(self, pod: str, name: str, want: DesiredAdapter | None) -> bool:
        have = self.held.get(pod, {}).get(name)
        if have is None or not have.is_resident:
            return False
        return want is None or is_current(have, want, self.memory.served.get((pod, name)))


@dataclass(frozen=True)
class Publication:
    """The placement a pass publishes, and what its statuses are built from."""
    adapters: AdapterSet
    holdings: Holdings
    placement: dict | None  # the payload to publish, with its new revision; None: unchanged
    memory: ReconcileMemory  # with the published revision and what it includes

    @property
    def revision(self) -> int:
        return self.memory.published.revision if self.memory.published is not None else 0


def build_publication(view: PoolView, plan: PassPlan, results: Iterable[CallResult],
                      memory: ReconcileMemory) -> Publication:
    adapters = freeze_new_failures(plan.adapters, memory.refusals, plan.pool_fingerprint)
    holdings = Holdings(held_after(view.observation.adapters, results), memory)
    payload = placement_payload(view, adapters, plan.placement, holdings)
    fingerprint = json.dumps(payload, sort_keys=True)
    published = memory.published or Published(0, "")
    update = None
    if fingerprint != published.payload:
        published = Published(published.revision + 1, fingerprint)
        update = {**payload, "revision": published.revision}
    # An adapter listed with a holder keeps the revision that first listed it; one dropped starts over.
    included = {name: memory.included.get(name, published.revision) for name, pods in payload["adapters"].items()
                if pods}
    return Publication(adapters, holdings, update, replace(memory, published=published, included=included))


def build_report(view: PoolView, plan: PassPlan, results: Iterable[CallResult], memory: ReconcileMemory,
                 routers: RouterView = RouterView()) -> Report:
    return report_publication(view, plan, build_publication(view, plan, results, memory), routers)


def report_publication(view: PoolView, plan: PassPlan, publication: Publication, routers: RouterView) -> Report:
    """The statuses once the placement is published and the routers were asked which revision they route on."""
    adapters, holdings, memory = publication.adapters, publication.holdings, publication.memory
    judgement = judge_routers(routers, publication.revision, memory.routers_behind, memory.router_revisions)
    bodies = {name: view.bodies[name] for name in plan.in_scope(view.bodies)}  # what the pass decided for
    statuses = {name: adapter_status(name, body, adapters, plan, holdings, has_ready_pod=bool(view.observation.urls),
                                     unrouted=unrouted(name, memory.included, routers.acks, judgement.revisions,
                                                       judgement.stale))
                for name, body in bodies.items() if not body["metadata"].get("deletionTimestamp")}
    pool = pool_status(view.pool.name, view.pool_body, view.observation, holdings.held, plan.placement,
                       capacity=view.pool.engine.max_cpu_loras, revision=publication.revision,
                       num_adapters=len(view.bodies), sizes=plan.sizes, routers=judgement.entries,
                       degraded=judgement.degraded)
    if view.keys is not None:
        pool["apiKeys"] = view.keys.status()
    released = frozenset(name for name, body in bodies.items() if body["metadata"].get("deletionTimestamp")
                         and not any(name in adapters_here for adapters_here in holdings.held.values()))
    memory = replace(memory, routers_behind=judgement.behind, router_revisions=judgement.revisions)
    return Report(statuses, pool, publication.placement, memory, released, judgement.next_pass_s)


def held_after(held: HeldByPod, results: Iterable[CallResult]) -> dict[str, dict[str, ObservedAdapter]]:
    """The observed adapters with every successful call applied (a new mapping; `held` is not changed)."""
    after = {pod: dict(adapters) for pod, adapters in held.items()}
    for result in results:
        action = result.action
        if result.error is not None:
            continue
        if isinstance(action, Unload):
            after[action.pod].pop(action.adapter, None)
            continue
        card = {**(result.card or {}), "id": action.adapter.name, "source": action.adapter.lora_path}
        after[action.pod][action.adapter.name] = ObservedAdapter.from_card(card)
    return after


def placement_payload(view: PoolView, adapters: AdapterSet, placement: Placement, holdings: Holdings) -> dict:
    """The router's contract without its revision (router/placement.py): each adapter's placed pods that hold its
    current revision, and the unreadable pods that still serve it (`unreadable_holders`); `onDevice`, those of
    them whose copy was in the device pool when the pass read it."""
    held = {name: holdings.holders(name, placement.pods_of(name), want) for name, want in adapters.desired.items()}
    held.update({name: holdings.holders(name, sorted(holdings.held), None) for name in adapters.left_alone()})
    kept = unreadable_holders(view, holdings.memory)
    for name, pods in held.items():
        want = adapters.desired.get(name)
        pods += [pod for pod in kept.get(name, ()) if pod not in pods and (
            want is None or holdings.memory.served.get((pod, name), want.source_revision) == want.source_revision)]
        pods.sort()
    unreadable = view.observation.unauthorized
    replicas = [{"pod": pod, "url": url, "ready": pod in view.observation.urls or pod in unreadable}
                for pod, url in view.observation.all_urls.items()]
    on_device = {name: [pod for pod in pods if holdings.is_on_device(pod, name)] for name, pods in held.items()}
    payload = {"pool": view.pool.name, "baseModel": view.pool.served_name,
               "replicas": sorted(replicas, key=lambda r: r["pod"]), "adapters": held,
               "onDevice": {name: pods for name, pods in on_device.items() if pods}}
    if view.keys is not None:  # digests only (kubelora.contract.keys)
        payload["apiKeys"] = view.keys.table.to_json()
    return payload


def unreadable_holders(view: PoolView, memory: ReconcileMemory) -> dict[str, list[str]]:
    """adapter -> the Ready pods that refuse the operator's token (`Observation.unauthorized`: started with a
    token the operator does not know, say one rotated while it was restarting) and that the last published
    placement listed for it. They still serve what they held, so the placement keeps them, ready, until they are
    replaced or answer again; the calls of the pass go to readable pods only."""
    unreadable = view.observation.unauthorized
    if not unreadable:
        return {}
    published = memory.published
    if published is not None and published.payload:
        listed = json.loads(published.payload).get("adapters") or {}
    else:  # the first pass after a restart: the ConfigMap as found
        listed = view.stored.pods_by_adapter if view.stored is not None else {}
    return {name: [pod for pod in pods if pod in unreadable] for name, pods in listed.items()
            if unreadable.intersection(pods)}


def adapter_status(name: str, body: dict, adapters: AdapterSet, plan: PassPlan, holdings: Holdings, *,
                   has_ready_pod: bool, unrouted: Failure | None = None) -> dict:
    generation = int(body["metadata"].get("generation") or 0)
    try:
        revision = AdapterSpec.from_body(body).source.revision
    except InvalidSpec:
        revision = ""
    retry_request = adapters.retry_requests.get(name)
    failure = adapters.invalid.get(name) or adapters.mismatched.get(name) or adapters.left_alone().get(name)
    if failure is not None:
        replicas = [holdings.replica(name, pod, None) for pod in holdings.holders(name, sorted(holdings.held), None)]
        is_refused = name in adapters.refused()
        return build_adapter_status(generation=generation, revision=revision, wanted=0, replicas=replicas,
                                    failure=failure, failed_revision=revision if is_refused else None,
                                    failed_pool_spec=plan.pool_fingerprint, retry_request=retry_request)
    want = adapters.desired[name]
    replicas = [holdings.replica(name, pod, want) for pod in plan.placement.pods_of(name)]
    pending = None if has_ready_pod else Failure("NoReadyReplicas", "no engine replica of the pool is ready")
    if pending is None and not replicas and plan.placement.wanted_by_adapter.get(name, 0) > 0:
        size = plan.sizes.get(name)
        needs = f"{size} bytes of device adapter pool and " if size else ""
        pending = Failure(INSUFFICIENT_CAPACITY, f"no ready replica has room for it: it needs {needs}one adapter "
                                                 "slot (engine.maxCpuLoras); the pool's status.capacityShortage says "
                                                 "how much is missing in all; it is still registered everywhere "
                                                 "and served on demand")
    status = build_adapter_status(generation=generation, revision=revision,
                                  wanted=plan.placement.wanted_by_adapter.get(name, 0), replicas=replicas,
                                  pending=pending, retry_request=retry_request, unrouted=unrouted)
    sizing = plan.sizings.get(name)  # replicas "auto": why desiredReplicas is what it is (None clears it)
    status["desiredReason"] = sizing.reason if sizing is not None else None
    return status


def pool_status(pool_name: str, body: dict, observation: Observation, held: HeldByPod, placement: Placement | None,
                *, capacity: int, revision: int, num_adapters: int, invalid: Failure | None = None,
                sizes: Mapping[str, int] | None = None, routers: list[dict] | None = None,
                degraded: Failure | None = None) -> dict:
    sizes = sizes or {}
    pods = []
    for pod in sorted(observation.pods, key=lambda p: p["metadata"]["name"]):
        name = pod["metadata"]["name"]
        placed = placement.adapters_on(name) if placement is not None else []
        here = held.get(name, {})
        entry = {"name": name, "ip": (pod.get("status") or {}).get("podIP") or "", "ready": name in observation.urls,
                 "adapters": [a for a in placed if a in here and here[a].is_resident],
                 "numRegistered": len(here), "freeSlots": max(capacity - len(placed), 0)}
        if name in observation.budgets:
            budget = observation.budgets[name]
            entry.update(adapterBudgetBytes=budget, freeBytes=max(budget - sum(sizes.get(a, 0) for a in placed), 0))
        pods.append(entry)
    status = build_pool_status(
        generation=int(body["metadata"].get("generation") or 0),
        spec_replicas=int((body.get("spec") or {}).get("replicas", 1)), num_pods=len(observation.pods), pods=pods,
        selector=names.selector_string(names.engine_selector(pool_name)), num_adapters=num_adapters,
        placement_revision=revision, invalid=invalid, routers=routers, degraded=degraded)
    status["capacityShortage"] = capacity_shortage(placement, sizes)
    return status


def capacity_shortage(placement: Placement | None, sizes: Mapping[str, int]) -> dict:
    """How much room the pool lacks for what was asked: copies placement could not place, the adapters short of
    copies, and the bytes those copies need (adapters of unknown size count 0)."""
    short = {a: placement.shortage(a) for a in placement.wanted_by_adapter} if placement is not None else {}
    short = {a: n for a, n in short.items() if n > 0}
    return {"numAdapters": len(short), "numCopies": sum(short.values()),
            "bytes": sum(n * sizes.get(a, 0) for a, n in short.items())}


def invalid_pool_status(pool_name: str, body: dict, invalid: Failure) -> dict:
    """A pool whose spec does not parse: no pods, no placement, Ready=False with the spec's reason."""
    return pool_status(pool_name, body, Observation([]), {}, None, capacity=0, revision=0, num_adapters=0,
                       invalid=invalid)


# Pending for these reasons needs someone to act (add capacity, create the pool or fix spec.pool): a warning.
PENDING_WARNINGS = (INSUFFICIENT_CAPACITY, POOL_NOT_FOUND)


def phase_event(name: str, old: dict, patch: dict) -> Event | None:
    """One event per phase change of an adapter (Failed, Degraded and Pending for PENDING_WARNINGS as warnings),
    and one when a Pending adapter turns Pending for one of PENDING_WARNINGS."""
    ready = next(c for c in patch["conditions"] if c["type"] == "Ready")
    old_ready = next((c for c in old.get("conditions") or [] if c.get("type") == "Ready"), {})
    is_pending_warning = patch["phase"] == Phase.PENDING.value and ready["reason"] in PENDING_WARNINGS
    if old.get("phase") == patch["phase"] and not (is_pending_warning and old_ready.get("reason") != ready["reason"]):
        return None
    is_warning = patch["phase"] in (Phase.FAILED.value, Phase.DEGRADED.value) or is_pending_warning
    return Event(name, is_warning, patch["phase"], f"{ready['reason']}: {ready['message']}")
