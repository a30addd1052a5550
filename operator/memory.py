"""What one pool's reconcile remembers between passes: one frozen value, replaced after each step, never mutated.

All of it is an optimisation or a copy of something the cluster also holds, so a restarted operator (empty
memory) converges the same way: the served revisions and refusals are read back from the adapters' status,
the previous placement and its revision from the published ConfigMap, and retries simply start over; after a
restart every adapter counts as included from the first revision published then, which the routers take within
that pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kubelora.operator.demand import DemandMemory
from kubelora.operator.status import Failure

PodAdapter = tuple[str, str]  # (pod, adapter)


@dataclass(frozen=True)
class Retry:
    """A (pod, adapter) call that failed transiently: not tried again before `retry_at`, unless the adapter's
    retry request (annotation kubelora.io/retry) changes."""
    num_failures: int
    retry_at: float  # time.time() seconds (the status shows it)
    message: str
    retry_request: str = ""


@dataclass(frozen=True)
class Refusal:
    """The engine refused one source revision of an adapter under one pool spec (`specs.pool_fingerprint`).

    It holds while both stay the same, and the adapter's retry request (annotation kubelora.io/retry) too; a new
    revision, a changed pool (say a raised maxLoraRank) or a new retry request tries once more.
    """
    revision: str
    pool_fingerprint: str
    failure: Failure
    retry_request: str = ""
    # Refusals because the files contradict spec.rank/spec.targets also end with the adapter's generation (a
    # corrected declaration is checked afresh); None: any generation.
    generation: int | None = None

    def holds_for(self, revision: str, pool_fingerprint: str, retry_request: str = "") -> bool:
        return (self.revision, self.pool_fingerprint, self.retry_request) == (revision, pool_fingerprint,
                                                                             retry_request)


@dataclass(frozen=True)
class Published:
    """The placement ConfigMap as last written: its revision and its payload without the revision."""
    revision: int
    payload: str  # "" when only the revision is known (read back after an operator restart)


@dataclass(frozen=True)
class ReconcileMemory:
    served: Mapping[PodAdapter, str] = field(default_factory=dict)  # source revision the operator loaded there
    retries: Mapping[PodAdapter, Retry] = field(default_factory=dict)
    refusals: Mapping[str, Refusal] = field(default_factory=dict)  # adapter -> its standing refusal
    previous: Mapping[str, tuple[str, ...]] | None = None  # adapter -> pods of the last placement (hysteresis)
    published: Published | None = None
    # adapter -> the first revision of its current run of published revisions listing a holder: a router that
    # took this revision or a later one routes it (routers.py)
    included: Mapping[str, int] = field(default_factory=dict)
    # router pod -> time.time() the operator first saw it behind the published revision (unanswered included)
    routers_behind: Mapping[str, float] = field(default_factory=dict)
    # router pod -> the last placement revision it acknowledged: a router that does not answer is judged by it
    router_revisions: Mapping[str, int] = field(default_factory=dict)
    demand: DemandMemory = field(default_factory=DemandMemory)  # measured demand and auto adapters' sizing
    # (pod, adapter) -> time.time() of the last preload that made an evicted placed copy resident again
    repaired: Mapping[PodAdapter, float] = field(default_factory=dict)
