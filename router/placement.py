"""The pool's placement as the operator publishes it (ConfigMap `<pool>-placement`, key `placement.json`).

    {"pool": "p", "baseModel": "tiny-llama", "revision": 17,
     "replicas": [{"pod": "p-engine-abcde", "url": "http://10.244.0.7:8000", "ready": true}],
     "adapters": {"tenant-a": ["p-engine-abcde"], "tenant-b": []},
     "onDevice": {"tenant-a": ["p-engine-abcde"]},
     "apiKeys": {"required": true, "keys": [{"digest": "<sha256 hex>", "adapters": ["tenant-a"], "baseModel": false}]}}

`apiKeys` (kubelora.contract.keys) is absent for a pool that requires no keys. `adapters` lists each adapter's
holders (resident in host or device memory); `onDevice`, optional, the holders whose copy is in the device pool
when the placement was written (the first tier routing prefers; docs/router.md). A pod listed on device but not
as a holder is ignored.

`parse_placement` turns that text into an immutable `Placement` or raises `ValueError` naming the field; the
router keeps serving the previous placement when a new one does not parse.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kubelora.contract.keys import OPEN, KeyTable, parse_table

PLACEMENT_KEY = "placement.json"


@dataclass(frozen=True)
class Replica:
    pod: str
    url: str  # http://<pod IP>:<port>, no trailing slash
    is_ready: bool


@dataclass(frozen=True)
class Placement:
    pool: str
    base_model: str
    revision: int
    replicas: tuple[Replica, ...]
    adapters: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    api_keys: KeyTable = OPEN
    on_device: Mapping[str, frozenset[str]] = field(default_factory=lambda: MappingProxyType({}))

    def ready_replicas(self) -> dict[str, Replica]:
        return {r.pod: r for r in self.replicas if r.is_ready}

    def holders(self, adapter: str) -> tuple[str, ...]:
        """Ready pods holding the adapter now (pods the placement lists but does not know are dropped)."""
        ready = self.ready_replicas()
        return tuple(pod for pod in self.adapters.get(adapter, ()) if pod in ready)

    def holder_tiers(self, adapter: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(ready holders with the adapter on device, the other ready holders)."""
        holders = self.holders(adapter)
        device = self.on_device.get(adapter, frozenset())
        return (tuple(pod for pod in holders if pod in device), tuple(pod for pod in holders if pod not in device))


def _expect(value, kind: type, name: str):
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"placement field {name!r} must be {kind.__name__}, got {type(value).__name__}")
    return value


def _parse_replica(item, index: int) -> Replica:
    _expect(item, dict, f"replicas[{index}]")
    pod = _expect(item.get("pod"), str, f"replicas[{index}].pod")
    url = _expect(item.get("url"), str, f"replicas[{index}].url")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"placement field 'replicas[{index}].url' must be an http(s) URL, got {url!r}")
    return Replica(pod=pod, url=url.rstrip("/"), is_ready=_expect(item.get("ready", False), bool,
                                                                  f"replicas[{index}].ready"))


def _parse_adapters(raw, field_name: str) -> dict[str, tuple[str, ...]]:
    adapters: dict[str, tuple[str, ...]] = {}
    for name, pods in _expect(raw, dict, field_name).items():
        _expect(pods, list, f"{field_name}[{name!r}]")
        adapters[name] = tuple(_expect(pod, str, f"{field_name}[{name!r}][]") for pod in pods)
    return adapters


def parse_placement(text: str) -> Placement:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{PLACEMENT_KEY} is not JSON: {exc}") from None
    _expect(raw, dict, "<root>")
    replicas = tuple(_parse_replica(item, i) for i, item in enumerate(_expect(raw.get("replicas", []), list,
                                                                              "replicas")))
    return Placement(pool=_expect(raw.get("pool", ""), str, "pool"),
                     base_model=_expect(raw.get("baseModel"), str, "baseModel"),
                     revision=_expect(raw.get("revision", 0), int, "revision"),
                     replicas=replicas,
                     adapters=MappingProxyType(_parse_adapters(raw.get("adapters", {}), "adapters")),
                     on_device=MappingProxyType({name: frozenset(pods) for name, pods in
                                                 _parse_adapters(raw.get("onDevice", {}), "onDevice").items()}),
                     api_keys=parse_table(raw.get("apiKeys")))
