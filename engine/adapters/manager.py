"""Adapter lifecycle: names -> revisions, known -> host -> device, reference counts, LRU tiers.

Threads: `load`/`unload`/`list` run in callers' threads (the HTTP server's). Reading and validating files
happens under a per-name lock only; the state lock (`_state`) guards the maps and is never held during I/O.
On-demand loads of `known` revisions run on this manager's small loader thread pool, started by `acquire`
(a request arrives) or `ensure_device` (the scheduler wants it): the engine step never waits on I/O.
`ensure_device` is called by the scheduler in the engine thread only; it copies host -> pool (no I/O).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kubelora.engine.adapters.peft_reader import read_adapter_spec, read_adapter_weights
from kubelora.engine.adapters.pool import DeviceLoRAPool, SlotView, module_costs, spec_bytes
from kubelora.engine.adapters.revision import AdapterRevision
from kubelora.engine.adapters.types import AdapterInfo, AdapterManagerConfig, AdapterStats, Residency, Tier
from kubelora.engine.adapters.spec import AdapterLimits, AdapterSpec
from kubelora.engine.errors import (AdapterError, AdapterExists, AdapterTooLarge, AdapterUnloading, InvalidAdapter,
                                    UnknownAdapter)
from kubelora.engine.model.config import ModelConfig

log = logging.getLogger(__name__)
MAX_NAME_LEN = 256


class _Entry:
    def __init__(self, current: AdapterRevision) -> None:
        self.current = current
        self.is_unloading = False


class AdapterManager:
    def __init__(self, config: AdapterManagerConfig, model: ModelConfig, pool: DeviceLoRAPool,
                 limits: AdapterLimits) -> None:
        self._config = config
        self._model = model
        self._pool = pool
        self._limits = limits
        self._state = threading.Lock()
        self._name_locks: dict[str, threading.Lock] = {}
        self._entries: dict[str, _Entry] = {}
        self._host_lru: OrderedDict[int, AdapterRevision] = OrderedDict()  # least recently used first
        self._device: dict[int, AdapterRevision] = {}
        self._executor = ThreadPoolExecutor(config.num_loader_threads, thread_name_prefix="kubelora-adapter-load")
        self._counts = {"loads": 0, "failures": 0, "device_evictions": 0, "host_evictions": 0}
        self._latencies: deque[tuple[str, float]] = deque(maxlen=256)  # (adapter name, seconds)
        self._retired: list[AdapterRevision] = []  # retired since the engine last asked (take_retired)

    # ---- control API (any thread) ----

    def load(self, name: str, path: str | Path, *, load_inplace: bool = False, preload: bool = True) -> AdapterInfo:
        """Validate and register `path` under `name`; with preload, stage its weights in host memory.

        Same name and revision again: success (no-op). A different revision needs load_inplace (else
        AdapterExists); in-flight requests finish on the old revision, new ones get the new one.
        """
        _check_name(name)
        with self._name_lock(name):
            spec = read_adapter_spec(name, path, self._model, self._limits)
            if self._bytes(spec) > self._pool.total_bytes:
                raise AdapterTooLarge(name, "max_lora_pool_bytes", f"the adapter takes {self._bytes(spec)} bytes of "
                                      f"the device adapter pool, which holds {self._pool.total_bytes}",
                                      limit=self._pool.total_bytes)
            with self._state:
                same = self._same_revision(name, spec, load_inplace)
                if same is not None and (not preload or same.tier is not Tier.KNOWN):
                    return self._info(self._entries[name])
            started = time.monotonic()
            host = read_adapter_weights(spec, self._model, self._pool.dtype, self._config.is_host_pinned) \
                if preload else None
            with self._state:
                if host is not None:
                    self._record_load(name, time.monotonic() - started)
                if same is not None and same is self._current(name):
                    self._attach_host(same, host)
                else:
                    self._install(name, AdapterRevision(spec, None, time.time()), host)
                return self._info(self._entries[name])

    def unload(self, name: str) -> bool:
        """Stop admitting requests for `name` and return; memory is freed once its in-flight requests finish.

        Returns False when nothing was loaded under that name (unload is idempotent).
        """
        with self._name_lock(name), self._state:
            entry = self._entries.get(name)
            if entry is None:
                return False
            entry.is_unloading = True
            self._retire(entry.current)
            return True

    def list(self) -> list[AdapterInfo]:
        with self._state:
            return [self._info(entry) for _, entry in sorted(self._entries.items())]

    def get(self, name: str) -> AdapterInfo | None:
        with self._state:
            entry = self._entries.get(name)
            return None if entry is None else self._info(entry)

    def stats(self) -> AdapterStats:
        with self._state:
            return AdapterStats(
                host_bytes=sum(r.host.num_bytes for r in self._host_lru.values()),
                pool_used_bytes=self._pool.used_bytes,
                pool_total_bytes=self._pool.total_bytes,
                num_loads=self._counts["loads"],
                num_load_failures=self._counts["failures"],
                num_device_evictions=self._counts["device_evictions"],
                num_host_evictions=self._counts["host_evictions"],
                load_latencies_s=tuple(self._latencies),
            )

    def module_costs(self) -> dict[str, dict[str, int]]:
        """What each module costs an adapter in the device pool (engine/adapters/pool.py: module_costs): an
        adapter's `bytes` is what these give for its ranks, and every mix whose bytes sum to at most the pool's
        total_bytes can be resident at once."""
        return module_costs(self._model, self._pool.dtype)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    # ---- engine API ----

    def acquire(self, name: str) -> AdapterRevision:
        """Bind a new request to the current revision (+1 ref); a `known` one starts loading off-thread."""
        with self._state:
            entry = self._entries.get(name)
            if entry is None:
                raise UnknownAdapter(name)
            if entry.is_unloading:
                raise AdapterUnloading(name)
            revision = entry.current
            revision.num_refs += 1
            if revision.tier is Tier.KNOWN:
                self._start_load(revision)
            return revision

    def release(self, revision: AdapterRevision) -> None:
        """-1 ref (a request finished or was aborted); frees a retired revision at zero. Never goes negative."""
        with self._state:
            if revision.num_refs <= 0:
                log.error("release of %r without a matching acquire ignored", revision)
                return
            revision.num_refs -= 1
            if revision.num_refs == 0 and revision.is_retired:
                self._free(revision)

    def ensure_device(self, revision: AdapterRevision, protected: set[AdapterRevision]) -> Residency:
        """Engine thread: make `revision` resident in the pool, evicting only revisions outside `protected`."""
        with self._state:
            if revision.is_on_device:
                self._touch(revision)
                return Residency.RESIDENT
            if revision.host is None:
                self._start_load(revision)
                return Residency.LOADING
            if not self._make_room(revision, protected | {revision}):
                return Residency.NO_ROOM
            self._device[revision.id] = revision
            revision.is_on_device = True
            self._touch(revision)
            return Residency.RESIDENT

    def prefetch_device(self, limit: int) -> int:
        """Engine thread, while no step is in flight: place up to `limit` host-tier adapters into free pool rows,
        most recently used first, evicting nothing; returns how many it placed. A registered adapter's first
        request then finds it resident instead of copying it in ahead of its prefill; a prefetched adapter is idle
        and the first to be evicted."""
        placed = 0
        with self._state:
            for revision in reversed(list(self._host_lru.values())):
                if placed >= limit:
                    break
                if revision.is_on_device or revision.is_retired or not self._could_fit(revision, []):
                    continue
                if self._pool.place(revision.id, revision.spec, revision.host):
                    self._device[revision.id] = revision
                    revision.is_on_device = True
                    placed += 1
        return placed

    def take_retired(self) -> list[AdapterRevision]:
        """Engine thread: the revisions unloaded or replaced since the last call (their cached KV blocks go)."""
        with self._state:
            retired, self._retired = self._retired, []
            return retired

    def take_load_error(self, revision: AdapterRevision) -> str | None:
        """The error of the last failed on-demand load (once); the next request for it retries."""
        with self._state:
            error, revision.load_error = revision.load_error, None
            return error

    def slot_view(self, revision: AdapterRevision) -> SlotView:
        with self._state:
            return self._pool.view(revision.id, revision.spec.scales)

    # ---- internals (callers hold self._state unless noted) ----

    def _name_lock(self, name: str) -> threading.Lock:
        with self._state:
            return self._name_locks.setdefault(name, threading.Lock())

    def _current(self, name: str) -> AdapterRevision | None:
        entry = self._entries.get(name)
        return None if entry is None or entry.is_unloading else entry.current

    def _same_revision(self, name: str, spec: AdapterSpec, load_inplace: bool) -> AdapterRevision | None:
        """The current revision when `spec` is the same one; raises AdapterExists for a different one."""
        current = self._current(name)
        if current is None:
            return None
        same_path = Path(current.spec.path).resolve() == Path(spec.path).resolve()
        if same_path and current.spec.revision == spec.revision:
            return current
        if not load_inplace:
            raise AdapterExists(name, f"already loaded from {current.spec.path!r} (revision "
                                      f"{current.spec.revision}); the new {spec.path!r} (revision {spec.revision}) "
                                      "needs load_inplace=true")
        return None

    def _install(self, name: str, revision: AdapterRevision, host) -> None:
        old = self._entries.get(name)
        self._entries[name] = _Entry(revision)
        if old is not None:
            self._retire(old.current)
        self._attach_host(revision, host)

    def _attach_host(self, revision: AdapterRevision, host) -> None:
        if host is None or revision.host is not None:
            return
        revision.host = host
        self._host_lru[revision.id] = revision
        self._enforce_host_limit()

    def _retire(self, revision: AdapterRevision) -> None:
        revision.is_retired = True
        self._retired.append(revision)
        if revision.num_refs == 0:
            self._free(revision)

    def _free(self, revision: AdapterRevision) -> None:
        """Drop every copy of a retired revision that no request uses any more."""
        self._pool.free(revision.id)
        self._device.pop(revision.id, None)
        self._host_lru.pop(revision.id, None)
        revision.is_on_device = False
        revision.host = None
        entry = self._entries.get(revision.name)
        if entry is not None and entry.current is revision:
            del self._entries[revision.name]

    def _start_load(self, revision: AdapterRevision) -> None:
        # A failure not yet delivered to the requests waiting for it is delivered first (take_load_error);
        # the next request after that retries. Retrying sooner would leave a second error pending for
        # requests that arrive later, and count the failure twice.
        if revision.is_loading or revision.load_error is not None:
            return
        revision.is_loading = True
        self._executor.submit(self._load_in_background, revision)

    def _load_in_background(self, revision: AdapterRevision) -> None:
        """Loader thread: read the weights of a `known` revision; no lock held while reading."""
        started = time.monotonic()
        host, error = None, None
        try:
            host = read_adapter_weights(revision.spec, self._model, self._pool.dtype, self._config.is_host_pinned)
        except AdapterError as exc:
            error = str(exc)
        except Exception as exc:  # noqa: BLE001 - any failure fails this adapter's requests, nothing else
            error = f"adapter {revision.name!r}: load failed: {type(exc).__name__}: {exc}"
        with self._state:
            revision.is_loading = False
            revision.last_error = error
            if error is not None:
                revision.load_error = error
                self._counts["failures"] += 1
                log.warning("on-demand load failed: %s", error)
            elif not (revision.is_retired and revision.num_refs == 0):
                self._record_load(revision.name, time.monotonic() - started)
                self._attach_host(revision, host)

    def _record_load(self, name: str, seconds: float) -> None:
        self._counts["loads"] += 1
        self._latencies.append((name, seconds))

    def _touch(self, revision: AdapterRevision) -> None:
        revision.last_used = time.monotonic()
        if revision.id in self._host_lru:
            self._host_lru.move_to_end(revision.id)

    def _enforce_host_limit(self) -> None:
        """LRU-evict host copies beyond max_cpu_loras; a revision with requests in flight keeps its copy."""
        excess = len(self._host_lru) - self._config.max_cpu_loras
        for revision in [r for r in self._host_lru.values() if r.num_refs == 0][:max(excess, 0)]:
            del self._host_lru[revision.id]
            revision.host = None
            self._counts["host_evictions"] += 1

    def _make_room(self, revision: AdapterRevision, protected: set[AdapterRevision]) -> bool:
        """Place `revision`, evicting unprotected residents (idle ones first, then least recently used)."""
        victims = sorted((r for r in self._device.values() if r not in protected),
                         key=lambda r: (r.num_refs > 0, r.last_used))
        if not self._could_fit(revision, victims):
            return False
        while not self._pool.place(revision.id, revision.spec, revision.host):
            victim = victims.pop(0)
            self._pool.free(victim.id)
            del self._device[victim.id]
            victim.is_on_device = False
            self._counts["device_evictions"] += 1
        return True

    def _could_fit(self, revision: AdapterRevision, victims: list[AdapterRevision]) -> bool:
        """The pool's room (counted at each resident's `adapter_bytes`) holds it once `victims` are out."""
        reclaimable = sum(self._bytes(v.spec) for v in victims)
        return self._pool.free_bytes() + reclaimable >= self._bytes(revision.spec)

    def _bytes(self, spec: AdapterSpec) -> int:
        return spec_bytes(self._model, self._pool.dtype, spec)

    def _info(self, entry: _Entry) -> AdapterInfo:
        revision = entry.current
        spec = revision.spec
        return AdapterInfo(
            name=spec.name,
            revision=spec.revision,
            path=spec.path,
            tier=revision.tier.value,
            rank=spec.max_rank,
            ranks=dict(spec.ranks),
            targets=spec.targets,
            bytes=self._bytes(spec),
            host_bytes=revision.host.num_bytes if revision.host is not None else 0,
            loaded_at=revision.loaded_at,
            base_model=spec.base_model,
            num_refs=revision.num_refs,
            is_loading=revision.is_loading,
            is_unloading=entry.is_unloading,
            last_error=revision.last_error,
            use_dora=spec.use_dora,
        )


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_LEN or name.strip() != name:
        raise InvalidAdapter(str(name), "name", "must be a non-empty string without surrounding spaces",
                             limit=f"1..{MAX_NAME_LEN} characters")
