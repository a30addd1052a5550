"""Request traces for the placement simulator: a simulated day of adapter requests, pure and seeded.

- **Popularity** is Zipf over a random order of the adapters (weight of rank k: 1 / k^zipf_s), so names say
  nothing about heat. Every hour `num_drift_swaps` adapters of the top 100 trade ranks with random others.
- **A tenant becomes hot**: from `hot_start` to `hot_end` (fractions of the day) one adapter from the cold half
  takes `hot_share` of all requests, then falls back.
- **Diurnal swing**: the request rate is `mean_rate x (1 - diurnal_swing x cos(2 pi t / day_s))`, lowest at
  midnight; arrivals are Poisson at that rate (drawn per minute). The day may be compressed (`day_s` below 24 h):
  demand then moves faster than in a real day, while the operator's windows keep their real seconds.
- **Requests** last a lognormal time (mean `mean_duration_s`: a generation under a full batch) and count
  tokens as the engine's `tokens_served` does (prompt + generated).
- **Failures**: `num_failures` replicas go down at random times for `down_s` each, then come back empty.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from dataclasses import dataclass

BUCKET_S = 60.0  # arrivals are drawn per minute at that minute's rate
PROMPT_TOKENS = 400
TOKENS_PER_S = 20.0  # generated tokens per second of a request's duration
DURATION_SIGMA = 0.8  # of the lognormal request duration


@dataclass(frozen=True)
class TraceConfig:
    num_replicas: int = 16
    num_adapters: int = 2000
    day_s: float = 6 * 3600.0  # the simulated day: one diurnal cycle
    mean_rate: float = 4.0  # requests per second, averaged over the day
    mean_duration_s: float = 30.0
    zipf_s: float = 1.1
    diurnal_swing: float = 0.5  # rate between (1 - swing) and (1 + swing) x mean
    hot_share: float = 0.15
    hot_start: float = 0.4  # of the day
    hot_end: float = 0.65
    num_drift_swaps: int = 5
    num_failures: int = 3
    down_s: float = 1200.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name, low in (("num_replicas", 1), ("num_adapters", 2), ("num_drift_swaps", 0), ("num_failures", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"TraceConfig.{name} must be >= {low}, got {getattr(self, name)}")
        for name in ("day_s", "mean_rate", "mean_duration_s", "zipf_s", "down_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TraceConfig.{name} must be > 0, got {getattr(self, name)}")
        if not 0.0 <= self.diurnal_swing < 1.0:
            raise ValueError(f"TraceConfig.diurnal_swing must be in [0, 1), got {self.diurnal_swing}")
        if not 0.0 <= self.hot_start <= self.hot_end <= 1.0:
            raise ValueError(f"TraceConfig.hot_start and hot_end must satisfy 0 <= start <= end <= 1, got "
                             f"{self.hot_start}, {self.hot_end}")
        if not 0.0 <= self.hot_share < 1.0:
            raise ValueError(f"TraceConfig.hot_share must be in [0, 1), got {self.hot_share}")


@dataclass(frozen=True)
class Request:
    at_s: float
    adapter: str
    duration_s: float
    num_tokens: int


@dataclass(frozen=True)
class Failure:
    replica: str
    down_at_s: float
    up_at_s: float


@dataclass(frozen=True)
class Trace:
    config: TraceConfig
    replicas: tuple[str, ...]
    adapters: tuple[str, ...]
    requests: tuple[Request, ...]  # by arrival time
    failures: tuple[Failure, ...]  # by down_at_s


def replica_names(num: int) -> tuple[str, ...]:
    return tuple(f"pool-engine-{i:02d}" for i in range(num))


def adapter_names(num: int) -> tuple[str, ...]:
    return tuple(f"tenant-{i:05d}" for i in range(num))


def rate_at(config: TraceConfig, t: float) -> float:
    return config.mean_rate * (1.0 - config.diurnal_swing * math.cos(2.0 * math.pi * t / config.day_s))


def generate(config: TraceConfig) -> Trace:
    rng = random.Random(config.seed)
    adapters = adapter_names(config.num_adapters)
    by_rank = list(adapters)
    rng.shuffle(by_rank)
    hot = by_rank[rng.randrange(config.num_adapters // 2, config.num_adapters)]
    requests: list[Request] = []
    cum_weights, hour = _popularity(config, by_rank, hot, 0.0), 0
    for start in itertools.takewhile(lambda s: s < config.day_s, itertools.count(0.0, BUCKET_S)):
        if int(start // 3600) != hour:
            hour = int(start // 3600)
            _drift(rng, by_rank, config.num_drift_swaps)
            cum_weights = _popularity(config, by_rank, hot, start)
        rate, t = rate_at(config, start), start
        while True:
            t += rng.expovariate(rate)
            if t >= min(start + BUCKET_S, config.day_s):
                break
            adapter = by_rank[bisect.bisect_left(cum_weights, rng.random() * cum_weights[-1])]
            requests.append(_request(rng, config, t, adapter))
    return Trace(config, replica_names(config.num_replicas), adapters, tuple(requests), _failures(rng, config))


def _popularity(config: TraceConfig, by_rank: list[str], hot: str, t: float) -> list[float]:
    """Cumulative weights over `by_rank`, the hot tenant's raised to `hot_share` of the total while it is hot."""
    weights = [1.0 / (k + 1) ** config.zipf_s for k in range(len(by_rank))]
    if config.hot_start * config.day_s <= t < config.hot_end * config.day_s and config.hot_share > 0:
        index = by_rank.index(hot)
        rest = sum(weights) - weights[index]
        weights[index] = rest * config.hot_share / (1.0 - config.hot_share)
    return list(itertools.accumulate(weights))


def _drift(rng: random.Random, by_rank: list[str], num_swaps: int) -> None:
    for _ in range(num_swaps):
        i, j = rng.randrange(min(100, len(by_rank))), rng.randrange(len(by_rank))
        by_rank[i], by_rank[j] = by_rank[j], by_rank[i]


def _request(rng: random.Random, config: TraceConfig, t: float, adapter: str) -> Request:
    mu = math.log(config.mean_duration_s) - DURATION_SIGMA ** 2 / 2  # so the mean is mean_duration_s
    duration = rng.lognormvariate(mu, DURATION_SIGMA)
    return Request(t, adapter, duration, PROMPT_TOKENS + int(duration * TOKENS_PER_S))


def _failures(rng: random.Random, config: TraceConfig) -> tuple[Failure, ...]:
    replicas = replica_names(config.num_replicas)
    failures = []
    for _ in range(config.num_failures):
        down = rng.uniform(0.05, 0.9) * config.day_s
        failures.append(Failure(rng.choice(replicas), down, down + config.down_s))
    return tuple(sorted(failures, key=lambda f: f.down_at_s))
