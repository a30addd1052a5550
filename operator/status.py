"""Adapter and pool status from one reconcile's outcome. Pure: the reconcile supplies what it saw and did.

Adapter phases (the enum in crds/loraadapters.yaml):
- Failed: the spec cannot be served (invalid, or the engine refused the current revision with a 4xx);
  not retried until the spec changes;
- Pending: nothing to place on yet (pool missing, no ready replica);
- Loading: placed, no placed replica serves the current revision yet;
- Degraded: some placed replicas serve it, not all (or capacity gave fewer copies than asked);
- Ready: every wanted copy serves the current revision.
Conditions: Valid, Loaded (every wanted copy), Ready (at least one copy serves the current revision).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from enum import Enum

from kubelora.operator.conditions import make_condition


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

    def to_dict(self) -> dict:
        entry: dict = {"pod": self.pod, "state": self.state.value}
        for key, value in (("revision", self.revision), ("contentRevision", self.content_revision),
                           ("residency", self.residency), ("lastError", self.last_error)):
            if value is not None:
                entry[key] = value
        if self.loaded_at:
            entry["loadedAt"] = dt.datetime.fromtimestamp(self.loaded_at, dt.timezone.utc).strftime(
                "%Y-%m-%dT%H:%M:%SZ")
        return entry


@dataclass(frozen=True)
class Failure:
    reason: str
    message: str


def build_adapter_status(*, generation: int, revision: str, wanted: int, replicas: list[ReplicaStatus],
                         failure: Failure | None = None, pending: Failure | None = None,
                         failed_revision: str | None = None, failed_pool_spec: str | None = None) -> dict:
    """The adapter's status (conditions without lastTransitionTime: merge_conditions adds it)."""
    num_ready = sum(1 for r in replicas if r.state is ReplicaState.LOADED)
    phase, conditions = _phase_and_conditions(generation, wanted, num_ready, failure, pending, replicas)
    status = {"observedGeneration": generation, "phase": phase.value, "revision": revision,
              "desiredReplicas": wanted, "readyReplicas": num_ready,
              "replicas": [r.to_dict() for r in replicas], "conditions": conditions}
    status["failedRevision"] = failed_revision  # None clears it (a merge patch)
    status["failedPoolSpec"] = failed_pool_spec if failed_revision else None
    return status


def _phase_and_conditions(generation: int, wanted: int, num_ready: int, failure: Failure | None,
                          pending: Failure | None, replicas: list[ReplicaStatus]) -> tuple[Phase, list[dict]]:
    def cond(type_: str, is_true: bool, reason: str, message: str) -> dict:
        return make_condition(type_, is_true, reason, message, generation)

    if failure is not None:
        return Phase.FAILED, [cond("Valid", False, failure.reason, failure.message),
                              cond("Loaded", False, failure.reason, failure.message),
                              cond("Ready", False, failure.reason, failure.message)]
    valid = cond("Valid", True, "Validated", "the spec is valid for its pool")
    if pending is not None:
        return Phase.PENDING, [valid, cond("Loaded", False, pending.reason, pending.message),
                               cond("Ready", False, pending.reason, pending.message)]
    errors = "; ".join(f"{r.pod}: {r.last_error}" for r in replicas if r.last_error)
    progress = f"{num_ready}/{wanted} replicas serve the current revision" + (f" ({errors})" if errors else "")
    if wanted > 0 and num_ready >= wanted:
        return Phase.READY, [valid, cond("Loaded", True, "AllReplicasLoaded", progress),
                             cond("Ready", True, "AllReplicasLoaded", progress)]
    # Every placed copy loaded, but placement found room for fewer than wanted (engine.maxCpuLoras per pod).
    is_short = len(replicas) < wanted and num_ready == len(replicas)
    if is_short:
        progress += f"; only {len(replicas)} replicas have room (engine.maxCpuLoras)"
    if num_ready == 0:
        return Phase.LOADING, [valid, cond("Loaded", False, "InsufficientCapacity" if is_short else "Loading",
                                           progress),
                               cond("Ready", False, "InsufficientCapacity" if is_short else "Loading", progress)]
    reason = "InsufficientCapacity" if is_short else "SomeReplicasLoaded"
    return Phase.DEGRADED, [valid, cond("Loaded", False, reason, progress),
                            cond("Ready", True, "SomeReplicasLoaded", progress)]


def build_pool_status(*, generation: int, spec_replicas: int, num_pods: int, pods: list[dict], selector: str,
                      num_adapters: int, placement_revision: int, invalid: Failure | None = None) -> dict:
    num_ready = sum(1 for pod in pods if pod.get("ready"))
    if invalid is not None:
        ready = make_condition("Ready", False, invalid.reason, invalid.message, generation)
    elif spec_replicas == 0:
        ready = make_condition("Ready", True, "ScaledToZero", "spec.replicas is 0", generation)
    elif num_ready >= spec_replicas:
        ready = make_condition("Ready", True, "AllReplicasReady", f"{num_ready}/{spec_replicas} replicas ready",
                               generation)
    else:
        ready = make_condition("Ready", False, "ReplicasNotReady", f"{num_ready}/{spec_replicas} replicas ready",
                               generation)
    return {"observedGeneration": generation, "replicas": num_pods, "readyReplicas": num_ready,
            "selector": selector, "numAdapters": num_adapters, "placementRevision": placement_revision,
            "pods": pods, "conditions": [ready]}
