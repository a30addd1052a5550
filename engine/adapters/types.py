"""Adapter lifecycle vocabulary shared by the manager, the scheduler and the server: tiers, residency answers,
what `list()` and `stats()` report, and the manager's config."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Tier(enum.Enum):
    KNOWN = "known"  # validated metadata only; weights are read from the source when needed
    HOST = "host"  # weights in host memory (pinned on CUDA)
    DEVICE = "device"  # weights in the device adapter pool (a host copy may or may not remain)


class Residency(enum.Enum):
    """`ensure_device`'s answer for one revision in one step."""

    RESIDENT = "resident"  # in the pool now
    LOADING = "loading"  # weights not in host memory yet (an on-demand load runs) or its load failed
    NO_ROOM = "no_room"  # in host memory, but the pool is full of adapters that running requests use


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
    use_dora: bool = False


@dataclass(frozen=True)
class AdapterManagerConfig:
    max_cpu_loras: int  # host tier LRU capacity (a soft limit: revisions with requests in flight stay)
    num_loader_threads: int = 1
    is_host_pinned: bool = False  # pin host copies (CUDA) so pool copies can be asynchronous

    def __post_init__(self) -> None:
        if self.max_cpu_loras < 1:
            raise ValueError(f"max_cpu_loras must be >= 1, got {self.max_cpu_loras}")
        if not 1 <= self.num_loader_threads <= 64:
            raise ValueError(f"num_loader_threads must be in [1, 64], got {self.num_loader_threads}")


@dataclass(frozen=True)
class AdapterStats:
    host_bytes: int
    pool_used_bytes: int
    pool_total_bytes: int
    num_loads: int  # host loads completed (explicit and on demand)
    num_load_failures: int
    num_device_evictions: int
    num_host_evictions: int
    load_latencies_s: tuple[tuple[str, float], ...]  # recent host loads (name, read + validate + stage s), oldest first
