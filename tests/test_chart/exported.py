"""The metric names our exporters really expose (engine, router, operator), read from their registries, and the
metric names a PromQL expression uses: the alerts and the dashboard may only query the former."""

from __future__ import annotations

import re
from types import SimpleNamespace

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",), "info": ("_info",)}


def _names(text: str) -> set[str]:
    return {family.name + suffix for family in text_string_to_metric_families(text)
            for suffix in SUFFIXES[family.type]}


def _engine_text() -> str:
    from kubelora.engine.server.metrics import EngineView, ServerMetrics

    snapshot = SimpleNamespace(
        num_running={"a": 1}, num_waiting={"a": 1}, last_batch_size=1, last_batch_tokens=1, last_batch_adapters=1,
        kv_cache_usage=0.5, num_kv_blocks=8, adapter_pool_used_bytes=1, adapter_pool_total_bytes=2,
        adapter_host_bytes=1, num_adapter_loads=1, num_adapter_load_failures=0, num_device_evictions=0,
        num_host_evictions=0, adapter_load_latencies_s=(("a", 0.1),), num_preemptions=0, num_steps=1,
        prefix_cache_tokens={"a": (4, 2)})
    adapter = SimpleNamespace(name="a", tier="device", revision="r", rank=8, bytes=1, host_bytes=1)
    return ServerMetrics("base", 2).render(EngineView(snapshot, [adapter])).decode()


def _router_text() -> str:
    from kubelora.router.metrics import RouterMetrics, RouterSnapshot

    metrics = RouterMetrics(lambda: RouterSnapshot(None, {}, 0, 0.0))
    return generate_latest(metrics.registry).decode()


def _operator_text() -> str:
    from kubelora.operator.metrics import build_default

    return generate_latest(build_default().registry).decode()


def exported_metric_names() -> set[str]:
    return _names(_engine_text()) | _names(_router_text()) | _names(_operator_text())


_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_MATCHERS = re.compile(r"\{[^}]*\}")
_NAME = re.compile(r"(?<![\w:$.])(kubelora_[a-z0-9_]+|vllm:[a-z0-9_:]+|process_[a-z0-9_]+)")


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in `expr` (ours are prefixed kubelora_ or vllm:); label names in groupings and matchers are
    not metric names and are dropped first."""
    return set(_NAME.findall(_MATCHERS.sub("", _GROUPING.sub("", expr))))
