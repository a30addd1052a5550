"""Pod status as the API expects it from a kubelet."""
from __future__ import annotations

import enum
from dataclasses import dataclass

from .container import ContainerRunner
from .timeutil import now_rfc3339


class PodPhase(enum.Enum):
    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class ConditionClock:
    """Keeps lastTransitionTime stable until a condition's status really changes."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[bool, str]] = {}

    def condition(self, kind: str, is_true: bool, reason: str = "") -> dict:
        previous = self._seen.get(kind)
        if previous is None or previous[0] != is_true:
            self._seen[kind] = (is_true, now_rfc3339())
        result = {"type": kind, "status": "True" if is_true else "False",
                  "lastTransitionTime": self._seen[kind][1]}
        return {**result, "reason": reason} if reason and not is_true else result


@dataclass(frozen=True)
class PodView:
    """What the status is computed from, gathered by the pod worker."""
    pod_key: str
    phase: PodPhase
    pod_ip: str
    host_ip: str
    start_time: str
    has_sandbox: bool
    init_runners: tuple[ContainerRunner, ...]
    runners: tuple[ContainerRunner, ...]
    is_initialized: bool
    message: str = ""


def build_pod_status(view: PodView, clock: ConditionClock) -> dict:
    is_ready = view.is_initialized and all(r.is_ready for r in view.runners) \
        and view.phase is PodPhase.RUNNING
    not_ready_reason = "PodCompleted" if view.phase in (PodPhase.SUCCEEDED, PodPhase.FAILED) \
        else "ContainersNotReady"
    status = {
        "phase": view.phase.value,
        "hostIP": view.host_ip, "hostIPs": [{"ip": view.host_ip}],
        "startTime": view.start_time,
        "conditions": [
            clock.condition("PodReadyToStartContainers", view.has_sandbox),
            clock.condition("Initialized", view.is_initialized, "ContainersNotInitialized"),
            clock.condition("ContainersReady", is_ready, not_ready_reason),
            clock.condition("Ready", is_ready, not_ready_reason),
        ],
        "containerStatuses": [r.status(view.pod_key) for r in view.runners],
    }
    if view.init_runners:
        status["initContainerStatuses"] = [r.status(view.pod_key) for r in view.init_runners]
    if view.pod_ip:
        status["podIP"], status["podIPs"] = view.pod_ip, [{"ip": view.pod_ip}]
    if view.message:
        status["message"] = view.message
    return status


def has_drifted(written: dict, listed: dict) -> bool:
    """True when the API's copy of a pod status (`listed`) lost what this kubelet wrote (`written`): the phase or
    one of its conditions differs. The node-lifecycle controller marks the pods of a NotReady node not Ready (for
    instance while the API server was down and heartbeats failed); the real kubelet's status manager compares the
    API's copy with its own and writes again, and so does this one (conditions others own are not compared)."""
    if listed.get("phase") != written["phase"] or listed.get("podIP", "") != written.get("podIP", ""):
        return True
    statuses = {c["type"]: c.get("status") for c in listed.get("conditions") or []}
    return any(statuses.get(c["type"]) != c["status"] for c in written["conditions"])
