"""Adapter and pool status from one reconcile's outcome. Pure: the reconcile supplies what it saw and did.

Adapter phases (the enum in crds/loraadapters.yaml):
- Failed: the spec cannot be served (invalid, or the engine refused the current revision permanently);
  not retried until the spec changes or a retry is asked for (annotation kubelora.io/retry);
- Pending: nothing to place on yet (pool missing, no ready replica) or no pod has room (InsufficientCapacity);
- Loading: placed, no placed replica serves the current revision yet (LoadRetrying: a transient failure is
  retried with backoff; the replicas show the last error and the next retry time);
- Degraded: some placed replicas serve it, not all (or capacity gave fewer copies than asked);
- Ready: every wanted copy serves the current revision, and every ready router routes it.
A loaded adapter that some ready router has not taken into its placement yet is Loading with Ready=False
`WaitingForRouters` (routers.py): a request through that router would get 404.
Conditions: Valid, Loaded (every wanted copy), Ready (at least one copy serves the current revision and every
ready router routes it), and
kstatus's Reconciling (progress is being made) and Stalled (stuck until something changes: Failed, or no
room), so `kubectl wait --for=condition=Ready`, Flux and Argo CD read the status without custom code.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from enum import Enum

from kubelora.operator.conditions import make_condition


INSUFFICIENT_CAPACITY = "InsufficientCapacity"
POOL_NOT_FOUND = "PoolNotFound"


class Phase(str, Enum):
    PENDING = "Pending"
    LOADING = "Loading"
    READY = "Ready"
    DEGRADED = "Degraded"
    FAILED = "Failed"


class ReplicaState(str, Enum):
    PENDING = "Pending"
    LOADING = "Loading"
    LOADED = "Loaded"
    FAILED = "Failed"


@dataclass(frozen=True)
class ReplicaStatus:
    pod: str
    state: ReplicaState
    revision: str | None = None
    content_revision: str | None = None
    residency: str | None = None
    loaded_at: float | None = None
    last_error: str | None = None
    next_retry_at: float | None = None  # time.time() of the next try after a transient failure

    def to_dict(self) -> dict:
        entry: dict = {"pod": self.pod, "state": self.state.value}
        for key, value in (("revision", self.revision), ("contentRevision", self.content_revision),
                           ("residency", self.residency), ("lastError", self.last_error)):
            if value is not None:
                entry[key] = value
        if self.loaded_at:
            entry["loadedAt"] = rfc3339(self.loaded_at)
        if self.next_retry_at:
            entry["nextRetryAt"] = rfc3339(self.next_retry_at)
        return entry


def rfc3339(epoch_s: float) -> str:
    return dt.datetime.fromtimestamp(epoch_s, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Failure:
    reason: str
    message: str


def build_adapter_status(*, generation: int, revision: str, wanted: int, replicas: list[ReplicaStatus],
                         failure: Failure | None = None, pending: Failure | None = None,
                         failed_revision: str | None = None, failed_pool_spec: str | None = None,
                         retry_request: str | None = None, unrouted: Failure | None = None) -> dict:
    """The adapter's status (conditions without lastTransitionTime: merge_conditions adds it).

    retry_request: the kubelora.io/retry annotation this status answers (a refusal holds while it stays);
    unrouted: why some ready router does not route it yet (it is not Ready then, however many copies serve)."""
    num_ready = sum(1 for r in replicas if r.state is ReplicaState.LOADED)
    phase, conditions = _phase_and_conditions(generation, wanted, num_ready, failure, pending, replicas)
    if unrouted is not None and phase in (Phase.READY, Phase.DEGRADED):
        phase, conditions = Phase.LOADING, _waiting_for_routers(conditions, unrouted)
    status = {"observedGeneration": generation, "phase": phase.value, "revision": revision,
              "desiredReplicas": wanted, "readyReplicas": num_ready,
              "replicas": [r.to_dict() for r in replicas], "conditions": conditions}
    status["failedRevision"] = failed_revision  # None clears it (a merge patch)
    status["failedPoolSpec"] = failed_pool_spec if failed_revision else None
    status["retryRequest"] = retry_request or None
    return status


def _phase_and_conditions(generation: int, wanted: int, num_ready: int, failure: Failure | None,
                          pending: Failure | None, replicas: list[ReplicaStatus]) -> tuple[Phase, list[dict]]:
    def cond(type_: str, is_true: bool, reason: str, message: str) -> dict:
        return make_condition(type_, is_true, reason, message, generation)

    def kstatus(reconciling: Failure | None, stalled: Failure | None, done: Failure) -> list[dict]:
        """Reconciling and Stalled (kstatus, abnormal-true): at most one of them is True."""
        shown_reconciling, shown_stalled = reconciling or done, stalled or done
        return [cond("Reconciling", reconciling is not None, shown_reconciling.reason, shown_reconciling.message),
                cond("Stalled", stalled is not None, shown_stalled.reason, shown_stalled.message)]

    if failure is not None:
        return Phase.FAILED, [cond("Valid", False, failure.reason, failure.message),
                              cond("Loaded", False, failure.reason, failure.message),
                              cond("Ready", False, failure.reason, failure.message),
                              *kstatus(None, failure, failure)]
    valid = cond("Valid", True, "Validated", "the spec is valid for its pool")
    if pending is not None:
        # No room is stuck until capacity is added; a missing pool or no ready pod heals by itself.
        is_stuck = pending.reason == INSUFFICIENT_CAPACITY
        return Phase.PENDING, [valid, cond("Loaded", False, pending.reason, pending.message),
                               cond("Ready", False, pending.reason, pending.message),
                               *kstatus(None if is_stuck else pending, pending if is_stuck else None, pending)]
    errors = "; ".join(f"{r.pod}: {r.last_error}" for r in replicas if r.last_error)
    progress = f"{num_ready}/{wanted} replicas serve the current revision" + (f" ({errors})" if errors else "")
    retries = sorted(r.next_retry_at for r in replicas if r.next_retry_at)
    if retries:
        progress += f"; next retry at {rfc3339(retries[0])}"
    if wanted > 0 and num_ready >= wanted:
        done = Failure("AllReplicasLoaded", progress)
        return Phase.READY, [valid, cond("Loaded", True, done.reason, progress),
                             cond("Ready", True, done.reason, progress), *kstatus(None, None, done)]
    if wanted > 0 and not replicas:  # wanted, but placement found no pod with room for it
        short = Failure(INSUFFICIENT_CAPACITY, progress + "; no replica has room for it")
        return _phase_and_conditions(generation, wanted, num_ready, None, short, replicas)
    # Every placed copy loaded, but placement found room for fewer than wanted.
    is_short = len(replicas) < wanted and num_ready == len(replicas)
    if is_short:
        progress += f"; only {len(replicas)} replicas have room"
    if num_ready == 0:
        reason = "LoadRetrying" if retries else "Loading"
        return Phase.LOADING, [valid, cond("Loaded", False, reason, progress), cond("Ready", False, reason, progress),
                               *kstatus(Failure(reason, progress), None, Failure(reason, progress))]
    state = Failure(INSUFFICIENT_CAPACITY if is_short else "SomeReplicasLoaded", progress)
    return Phase.DEGRADED, [valid, cond("Loaded", False, state.reason, progress),
                            cond("Ready", True, "SomeReplicasLoaded", progress),
                            *kstatus(None if is_short else state, state if is_short else None, state)]


def _waiting_for_routers(conditions: list[dict], unrouted: Failure) -> list[dict]:
    """Ready=False and Reconciling=True with the routers' reason; Valid and Loaded as they were."""
    replaced = {"Ready": False, "Reconciling": True, "Stalled": False}
    return [{**c, "status": "True" if replaced[c["type"]] else "False", "reason": unrouted.reason,
             "message": unrouted.message} if c["type"] in replaced else c for c in conditions]


def build_pool_status(*, generation: int, spec_replicas: int, num_pods: int, pods: list[dict], selector: str,
                      num_adapters: int, placement_revision: int, invalid: Failure | None = None,
                      routers: list[dict] | None = None, degraded: Failure | None = None) -> dict:
    """routers: the pool's router pods and the revision each routes on; degraded: RouterPlacementStale."""
    num_ready = sum(1 for pod in pods if pod.get("ready"))
    if invalid is not None:
        conditions = pool_conditions(generation, False, invalid, is_stalled=True)
    elif spec_replicas == 0:
        conditions = pool_conditions(generation, True, Failure("ScaledToZero", "spec.replicas is 0"), degraded=degraded)
    else:
        counted = f"{num_ready}/{spec_replicas} replicas ready"
        is_ready = num_ready >= spec_replicas
        conditions = pool_conditions(generation, is_ready,
                                     Failure("AllReplicasReady" if is_ready else "ReplicasNotReady", counted),
                                     degraded=degraded)
    status = {"observedGeneration": generation, "replicas": num_pods, "readyReplicas": num_ready,
              "selector": selector, "numAdapters": num_adapters, "placementRevision": placement_revision,
              "pods": pods, "routers": routers or [], "conditions": conditions}
    return status


ROUTERS_CURRENT = Failure("RoutersCurrent", "no router lags the published placement by more than 10 s")


def pool_conditions(generation: int, is_ready: bool, state: Failure, *, is_stalled: bool = False,
                    degraded: Failure | None = None) -> list[dict]:
    """Ready, kstatus's Reconciling (replicas on their way) and Stalled (an invalid spec), and Degraded
    (abnormal-true, as kstatus wants extra conditions: RouterPlacementStale while a router routes on an old
    placement; the engines may all be ready meanwhile, so Ready does not say it)."""
    is_reconciling = not is_ready and not is_stalled
    shown = degraded or ROUTERS_CURRENT
    return [*(make_condition(type_, value, state.reason, state.message, generation)
              for type_, value in (("Ready", is_ready), ("Reconciling", is_reconciling), ("Stalled", is_stalled))),
            make_condition("Degraded", degraded is not None, shown.reason, shown.message, generation)]
