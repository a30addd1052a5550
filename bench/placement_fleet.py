"""The simulated engine replicas: each one's two adapter tiers, in-flight requests and served-token counters.

Per replica, as the engine keeps them: a host tier of `max_cpu_loras` adapters and, within it, a device tier of
`max_loras`, each least-recently-used; an adapter with requests in flight on the replica is never evicted from
the host tier (the engine's rule), so a tier full of busy adapters overflows for a while. A request whose adapter
is in neither tier is a miss and loads it into the host tier; one whose adapter is only in the host tier costs a
device swap.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TierConfig:
    max_loras: int = 4  # device tier: the LoRAPool's default maxLoras
    # host tier: room for 2,000 adapters' copies on 16 replicas (the engine's default 16 and the LoRAPool's 8
    # cannot hold one copy of each; docs/benchmarks-placement.md, Method)
    max_cpu_loras: int = 256

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"TierConfig.max_loras must be >= 1, got {self.max_loras}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"TierConfig.max_cpu_loras must be >= max_loras ({self.max_loras}), "
                             f"got {self.max_cpu_loras}")


@dataclass
class Counts:
    num_requests: int = 0
    num_misses: int = 0  # adapter in neither tier, its first request anywhere excluded
    num_loads: int = 0  # into a host tier: misses, first requests and preloads
    num_preloads: int = 0
    num_swaps: int = 0  # host tier -> device tier


@dataclass
class ReplicaState:
    tiers: TierConfig
    host: OrderedDict[str, None] = field(default_factory=OrderedDict)  # least recent first
    device: OrderedDict[str, None] = field(default_factory=OrderedDict)
    busy: dict[str, int] = field(default_factory=dict)  # adapter -> requests in flight here
    tokens_served: dict[str, int] = field(default_factory=dict)  # since this replica started
    num_in_flight: int = 0

    def serve(self, adapter: str, counts: Counts, is_first: bool) -> None:
        """Start a request for `adapter` here, loading it as the engine would."""
        counts.num_requests += 1
        if adapter not in self.host:
            counts.num_misses += 0 if is_first else 1
            self.load(adapter, counts)
        self.host.move_to_end(adapter)
        if adapter in self.device:
            self.device.move_to_end(adapter)
        else:
            counts.num_swaps += 1
            self.device[adapter] = None
            if len(self.device) > self.tiers.max_loras:
                self.device.popitem(last=False)
        self.busy[adapter] = self.busy.get(adapter, 0) + 1
        self.num_in_flight += 1

    def finish(self, adapter: str, num_tokens: int) -> None:
        self.busy[adapter] -= 1
        if not self.busy[adapter]:
            del self.busy[adapter]
        self.num_in_flight -= 1
        self.tokens_served[adapter] = self.tokens_served.get(adapter, 0) + num_tokens

    def load(self, adapter: str, counts: Counts) -> None:
        counts.num_loads += 1
        self.host[adapter] = None
        while len(self.host) > self.tiers.max_cpu_loras:
            idle = next((a for a in self.host if a not in self.busy and a != adapter), None)
            if idle is None:
                break
            del self.host[idle]
            self.device.pop(idle, None)

    def preload(self, adapter: str, counts: Counts) -> None:
        if adapter not in self.host:
            counts.num_preloads += 1
            self.load(adapter, counts)
