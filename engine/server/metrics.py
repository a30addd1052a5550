"""Prometheus metrics on a private registry.

Per-request values (tokens, TTFT, TPOT, finishes, explicit load times) are observed as requests finish.
Engine state (queues, residency, pool bytes, counters kept by the engine) is read once per scrape: `render`
takes one `EngineView` and a custom collector turns it into gauges, so every registered adapter appears in
every scrape, idle or not (routers need to see what is resident, not only what is busy).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:  # the engine's public names; no import cost at runtime
    from kubelora.engine import AdapterInfo, EngineSnapshot, RequestOutput
    from kubelora.engine.model.quantized import BaseWeightsInfo

TIERS = ("known", "host", "device")
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
LOAD_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass(frozen=True)
class EngineView:
    snapshot: EngineSnapshot
    adapters: list[AdapterInfo]  # every registered adapter (not draining for unload)


class ServerMetrics:
    def __init__(self, base_name: str, max_loras: int | None, base_weights: BaseWeightsInfo | None = None) -> None:
        """max_loras: the engine's count limit of distinct adapters per batch (None: the pool's bytes decide);
        base_weights: the base's format and bytes as stored (None: not reported)."""
        self.base_name = base_name
        self.registry = CollectorRegistry(auto_describe=True)
        self._engine = _EngineCollector(base_name, max_loras, base_weights)
        self.registry.register(self._engine)
        by_adapter = dict(labelnames=["adapter"], registry=self.registry)
        self.prompt_tokens = Counter("kubelora_prompt_tokens", "Prompt tokens of finished requests", **by_adapter)
        self.generation_tokens = Counter("kubelora_generation_tokens", "Generated tokens of finished requests",
                                         **by_adapter)
        self.requests = Counter("kubelora_requests", "Finished requests by finish reason",
                                labelnames=["adapter", "finish_reason"], registry=self.registry)
        self.ttft = Histogram("kubelora_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=TTFT_BUCKETS, **by_adapter)
        self.queue_time = Histogram("kubelora_request_queue_time_seconds",
                                    "Arrival to the first step that computed part of the prompt",
                                    buckets=TTFT_BUCKETS, **by_adapter)
        self.prefill_time = Histogram("kubelora_request_prefill_time_seconds",
                                      "The first step that computed part of the prompt to the first generated token",
                                      buckets=TTFT_BUCKETS, **by_adapter)
        self.tpot = Histogram("kubelora_time_per_output_token_seconds", "Mean time between generated tokens",
                              buckets=TPOT_BUCKETS, **by_adapter)
        self.load_seconds = Histogram("kubelora_adapter_load_seconds",
                                      "Explicit adapter loads over HTTP: fetch, validate, stage in host memory",
                                      buckets=LOAD_BUCKETS, **by_adapter)
        self.host_load_seconds = Histogram("kubelora_adapter_host_load_seconds",
                                           "Every host load in the engine (explicit and on demand)",
                                           buckets=LOAD_BUCKETS, **by_adapter)
        self._num_loads_seen = 0
        # adapter -> prompt + generated tokens of its finished requests since start: the demand the operator
        # sizes an adapter's copies by (read on the admin port's model list; touched on the event loop only)
        self.tokens_served: dict[str, int] = {}

    def label(self, adapter: str | None) -> str:
        return adapter or self.base_name

    def observe_finished(self, output: RequestOutput, now: float | None = None) -> None:
        adapter = self.label(output.adapter)
        num_generated = len(output.token_ids)
        self.requests.labels(adapter, output.finish_reason or "unknown").inc()
        self.prompt_tokens.labels(adapter).inc(output.num_prompt_tokens)
        self.generation_tokens.labels(adapter).inc(num_generated)
        if output.adapter is not None:
            self.tokens_served[output.adapter] = (self.tokens_served.get(output.adapter, 0)
                                                  + output.num_prompt_tokens + num_generated)
        if output.first_token_time is None:
            return
        self.ttft.labels(adapter).observe(max(0.0, output.first_token_time - output.arrival_time))
        if output.first_scheduled_time is not None:
            self.queue_time.labels(adapter).observe(max(0.0, output.first_scheduled_time - output.arrival_time))
            self.prefill_time.labels(adapter).observe(max(0.0, output.first_token_time - output.first_scheduled_time))
        if num_generated > 1:
            end = time.time() if now is None else now
            self.tpot.labels(adapter).observe(max(0.0, end - output.first_token_time) / (num_generated - 1))

    def observe_load(self, adapter: str, seconds: float) -> None:
        self.load_seconds.labels(adapter).observe(seconds)

    def render(self, view: EngineView | None) -> bytes:
        """The exposition text; `view` None (engine not started yet) leaves the engine gauges out."""
        if view is not None:
            self._observe_host_loads(view.snapshot)
        self._engine.view = view
        try:
            return generate_latest(self.registry)
        finally:
            self._engine.view = None

    def _observe_host_loads(self, snapshot: EngineSnapshot) -> None:
        """The engine keeps a count and the most recent latencies: observe the ones not seen yet."""
        new = snapshot.num_adapter_loads - self._num_loads_seen
        self._num_loads_seen = snapshot.num_adapter_loads
        recent = snapshot.adapter_load_latencies_s
        for name, seconds in recent[max(0, len(recent) - new):]:
            self.host_load_seconds.labels(adapter=name).observe(seconds)


class _EngineCollector(Collector):
    def __init__(self, base_name: str, max_loras: int | None, base_weights: BaseWeightsInfo | None) -> None:
        self.base_name = base_name
        self.max_loras = max_loras
        self.base_weights = base_weights
        self.view: EngineView | None = None

    def describe(self) -> list[Metric]:
        return []  # the families depend on the view; nothing to declare up front

    def collect(self) -> Iterator[Metric]:
        if self.base_weights is not None:  # fixed at start-up: no view needed
            yield from _base_families(self.base_name, self.base_weights)
        if self.view is None:
            return
        yield from _adapter_families(self.view, self.base_name)
        yield from _engine_families(self.view.snapshot)
        yield from _vllm_families(self.view, self.base_name, self.max_loras)


LEVELS = {"device": "gpu", "host": "cpu", "known": "disk"}  # our tiers in vllm:lora_adapter_loaded's levels


def _gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def _adapter_families(view: EngineView, base_name: str) -> Iterator[Metric]:
    snap = view.snapshot
    running = _gauge("kubelora_requests_running", "Requests in the running batch", ["adapter"])
    waiting = _gauge("kubelora_requests_waiting", "Requests waiting for admission", ["adapter"])
    keys = {"", *(a.name for a in view.adapters), *snap.num_running, *snap.num_waiting}
    for key in sorted(keys):
        running.add_metric([key or base_name], snap.num_running.get(key, 0))
        waiting.add_metric([key or base_name], snap.num_waiting.get(key, 0))
    residency = _gauge("kubelora_adapter_residency", "1 for the tier the adapter is in (known, host, device)",
                       ["adapter", "tier"])
    info = _gauge("kubelora_adapter_info", "Registered adapter revision", ["adapter", "revision", "rank"])
    device_bytes = _gauge("kubelora_adapter_device_bytes", "Device pool bytes at the adapter's own ranks",
                          ["adapter"])
    host_bytes = _gauge("kubelora_adapter_host_bytes", "Host memory held by the adapter's copy", ["adapter"])
    for a in view.adapters:
        for tier in TIERS:
            residency.add_metric([a.name, tier], 1.0 if a.tier == tier else 0.0)
        info.add_metric([a.name, a.revision, str(a.rank)], 1.0)
        device_bytes.add_metric([a.name], a.bytes)
        host_bytes.add_metric([a.name], a.host_bytes)
    yield from (running, waiting, residency, info, device_bytes, host_bytes)
    queries = CounterMetricFamily("kubelora_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  labels=["adapter"])
    hits = CounterMetricFamily("kubelora_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                               labels=["adapter"])
    for key, (num_queries, num_hits) in sorted(snap.prefix_cache_tokens.items()):
        queries.add_metric([key or base_name], num_queries)
        hits.add_metric([key or base_name], num_hits)
    yield from (queries, hits)


def _base_families(base_name: str, base: BaseWeightsInfo) -> Iterator[Metric]:
    info = _gauge("kubelora_base_model_info", "The base model and its weights' format (bfloat16, fp8-...)",
                  ["model", "format"])
    info.add_metric([base_name, base.format], 1.0)
    yield info
    yield GaugeMetricFamily("kubelora_base_weight_bytes", "The base weights' bytes as stored", value=base.bytes)


def _engine_families(snap: EngineSnapshot) -> Iterator[Metric]:
    yield GaugeMetricFamily("kubelora_batch_size", "Sequences in the last step", value=snap.last_batch_size)
    yield GaugeMetricFamily("kubelora_batch_tokens", "Tokens in the last step", value=snap.last_batch_tokens)
    yield GaugeMetricFamily("kubelora_batch_adapters", "Distinct adapters in the last step",
                            value=snap.last_batch_adapters)
    yield GaugeMetricFamily("kubelora_kv_cache_usage_ratio", "Fraction of KV cache blocks in use",
                            value=snap.kv_cache_usage)
    yield GaugeMetricFamily("kubelora_kv_cache_blocks", "KV cache blocks", value=snap.num_kv_blocks)
    pool = _gauge("kubelora_adapter_pool_bytes", "Device adapter pool bytes by state", ["state"])
    pool.add_metric(["used"], snap.adapter_pool_used_bytes)
    pool.add_metric(["free"], snap.adapter_pool_total_bytes - snap.adapter_pool_used_bytes)
    yield pool
    yield GaugeMetricFamily("kubelora_adapter_host_pool_bytes", "Host memory held by adapter copies",
                            value=snap.adapter_host_bytes)
    yield CounterMetricFamily("kubelora_adapter_loads", "Host loads completed", value=snap.num_adapter_loads)
    yield CounterMetricFamily("kubelora_adapter_load_failures", "Host loads failed",
                              value=snap.num_adapter_load_failures)
    evictions = CounterMetricFamily("kubelora_adapter_evictions", "Adapter copies evicted", labels=["tier"])
    evictions.add_metric(["device"], snap.num_device_evictions)
    evictions.add_metric(["host"], snap.num_host_evictions)
    yield evictions
    yield CounterMetricFamily("kubelora_preemptions", "Running requests preempted for KV space",
                              value=snap.num_preemptions)
    yield CounterMetricFamily("kubelora_engine_steps", "Engine steps run", value=snap.num_steps)


def lora_capacity(view: EngineView, max_loras: int | None) -> int:
    """Distinct adapters a batch can hold now: the device pool's bytes over the running adapters' mean size
    (the resident ones' when none runs), capped by the count limit; never below the adapters running."""
    by_name = {a.name: a for a in view.adapters}
    running = [by_name[k].bytes for k, n in view.snapshot.num_running.items() if n and k in by_name]
    sizes = running or [a.bytes for a in view.adapters if a.tier == "device"]
    capacity = view.snapshot.adapter_pool_total_bytes * len(sizes) // sum(sizes) if sum(sizes) else max_loras or 0
    if max_loras is not None:
        capacity = min(capacity, max_loras)
    return max(capacity, len(running))


def _vllm_families(view: EngineView, base_name: str, max_loras: int | None) -> Iterator[Metric]:
    """The series existing Gateway API inference routers read from vLLM pods, with vLLM's meaning.

    `vllm:lora_requests_info`: `running_lora_adapters` are the adapters with requests running, `waiting_lora_adapters`
    those with requests waiting and none running, `max_lora` how many distinct adapters a batch holds (a router
    compares the running count with it: `lora_capacity`); the value is the scrape time, as vLLM sets it.
    `vllm:lora_adapter_loaded{adapter_name, level, pinned}`: 1 per registered adapter at its memory level (gpu:
    the device pool, cpu: host memory, disk: registered only); nothing is pinned.
    """
    snap = view.snapshot
    running = sorted(k for k, n in snap.num_running.items() if k and n)
    waiting = sorted(k for k, n in snap.num_waiting.items() if k and n and k not in running)
    info = _gauge("vllm:lora_requests_info", "Running and waiting LoRA adapters",
                  ["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
    info.add_metric([str(lora_capacity(view, max_loras)), ",".join(running), ",".join(waiting)], time.time())
    yield info
    loaded = _gauge("vllm:lora_adapter_loaded", "Registered LoRA adapters by memory level",
                    ["adapter_name", "level", "pinned"])
    for a in view.adapters:
        loaded.add_metric([a.name, LEVELS[a.tier], "false"], 1.0)
    yield loaded
    for name, doc, value in (
        ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
         sum(q for q, _ in snap.prefix_cache_tokens.values())),
        ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache",
         sum(h for _, h in snap.prefix_cache_tokens.values())),
    ):
        family = CounterMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([base_name], value)
        yield family
    for name, doc, value in (
        ("vllm:num_requests_running", "Requests running", sum(snap.num_running.values())),
        ("vllm:num_requests_waiting", "Requests waiting", sum(snap.num_waiting.values())),
        ("vllm:kv_cache_usage_perc", "KV cache usage (1 = full)", snap.kv_cache_usage),
        ("vllm:gpu_cache_usage_perc", "KV cache usage (1 = full), older name", snap.kv_cache_usage),
    ):
        family = _gauge(name, doc, ["model_name"])
        family.add_metric([base_name], value)
        yield family
