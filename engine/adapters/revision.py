"""Per-revision adapter state: the known -> host -> device tiers, reference counts, load status."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

from kubelora.engine.adapters.spec import AdapterSpec, HostAdapter

_ids = itertools.count(1)


class Tier(enum.Enum):
    KNOWN = "known"  # validated metadata only; weights are read from the source when needed
    HOST = "host"  # weights in host memory (pinned on CUDA)
    DEVICE = "device"  # weights in the device adapter pool (a host copy may or may not remain)


class AdapterRevision:
    """One revision of one adapter name. Mutated only under the AdapterManager's state lock.

    `num_refs` counts admitted requests (waiting or running) bound to this revision: an in-place reload or an
    unload retires the revision, whose memory is freed when the count returns to zero.
    """

    def __init__(self, spec: AdapterSpec, host: HostAdapter | None, loaded_at: float) -> None:
        self.id = next(_ids)  # pool owner key; unique across revisions of every name
        self.spec = spec
        self.host = host
        self.is_on_device = False
        self.num_refs = 0
        self.is_loading = False
        self.is_retired = False
        self.load_error: str | None = None  # pending failure for the scheduler to deliver (taken once)
        self.last_error: str | None = None  # last on-demand load failure, for listing
        self.loaded_at = loaded_at
        self.last_used = loaded_at

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def tier(self) -> Tier:
        if self.is_on_device:
            return Tier.DEVICE
        return Tier.HOST if self.host is not None else Tier.KNOWN

    def __repr__(self) -> str:
        return f"AdapterRevision({self.name!r}, {self.spec.revision}, {self.tier.value}, refs={self.num_refs})"


@dataclass(frozen=True)
class AdapterInfo:
    """What `AdapterManager.list()` reports for one adapter name (its current revision)."""

    name: str
    revision: str
    path: str
    tier: str  # "device" | "host" | "known"
    rank: int  # max over modules
    ranks: dict[str, int]
    targets: tuple[str, ...]
    bytes: int  # device pool bytes at the adapter's own ranks
    host_bytes: int  # 0 unless a host copy is resident
    loaded_at: float  # time.time() of registration
    base_model: str
    num_refs: int  # requests in flight (waiting or running) on this revision
    is_loading: bool
    is_unloading: bool
    last_error: str | None
