"""What one pool's reconcile remembers between passes: one frozen value, replaced after each step, never mutated.

All of it is an optimisation or a copy of something the cluster also holds, so a restarted operator (empty
memory) converges the same way: the served revisions and refusals are read back from the adapters' status,
the previous placement and its revision from the published ConfigMap, and retries simply start over.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

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
