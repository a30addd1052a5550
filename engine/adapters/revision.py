"""Per-revision adapter state: the known -> host -> device tiers, reference counts, load status."""

from __future__ import annotations

import itertools

from kubelora.engine.adapters.spec import AdapterSpec, HostAdapter
from kubelora.engine.adapters.types import Tier

_ids = itertools.count(1)


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
