"""What the kopf handlers share in one operator process: clients, settings and per-pool triggers."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field

import aiohttp

from kubelora.operator.kube import Kube
from kubelora.operator.settings import OperatorSettings


@dataclass
class Runtime:
    settings: OperatorSettings
    kube: Kube
    kube_session: aiohttp.ClientSession
    engine_session: aiohttp.ClientSession
    triggers: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)
    # (namespace, pool, adapter) -> set once a reconcile pass left no observed pod holding the deleted adapter
    releases: dict[tuple[str, str, str], asyncio.Event] = field(default_factory=dict)
    # pools one of whose owned objects was deleted: their next pass re-applies them (take_heal_request)
    heal_requests: set[tuple[str, str]] = field(default_factory=set)
    # (namespace, pool) -> the adapters whose objects changed since its last pass started, when nothing else did;
    # None: something else changed too (a pod, the pool, an engine's adapter set, a Secret): a whole pass
    changes: dict[tuple[str, str], set[str] | None] = field(default_factory=dict)

    def trigger_for(self, namespace: str, pool: str) -> asyncio.Event:
        return self.triggers.setdefault((namespace, pool), asyncio.Event())

    def trigger(self, namespace: str, pool: str) -> None:
        """Ask the pool's reconcile daemon for a whole pass now (no-op for a pool without a daemon yet)."""
        event = self.triggers.get((namespace, pool))
        if event is not None:
            self.changes[(namespace, pool)] = None
            event.set()

    def trigger_adapter(self, namespace: str, pool: str, adapter: str) -> None:
        """Ask for a pass now because `adapter`'s object changed: one that decides for the changed adapters only,
        unless something else changed since the last pass too (reconcile.PoolReconciler.reconcile)."""
        event = self.triggers.get((namespace, pool))
        if event is not None:
            changed = self.changes.setdefault((namespace, pool), set())
            if changed is not None:
                changed.add(adapter)
            event.set()

    def take_changes(self, namespace: str, pool: str) -> frozenset[str] | None:
        """The adapters changed since the last call, when nothing else changed (None: a whole pass is due, or
        nothing was asked: the daemon woke for its resync)."""
        changed = self.changes.pop((namespace, pool), None)
        return None if changed is None else frozenset(changed)

    def request_heal(self, namespace: str, pool: str) -> None:
        """An object the pool owns went away: re-apply what it owns in a pass now, not at the next resync."""
        if self.has_pool(namespace, pool):
            self.heal_requests.add((namespace, pool))
            self.trigger(namespace, pool)

    def take_heal_request(self, namespace: str, pool: str) -> bool:
        """True once per request_heal (the pass that reads it heals)."""
        if (namespace, pool) in self.heal_requests:
            self.heal_requests.discard((namespace, pool))
            return True
        return False

    def has_pool(self, namespace: str, pool: str) -> bool:
        return (namespace, pool) in self.triggers

    def forget(self, namespace: str, pool: str) -> None:
        self.triggers.pop((namespace, pool), None)
        self.heal_requests.discard((namespace, pool))
        self.changes.pop((namespace, pool), None)
        for key in [k for k in self.releases if k[:2] == (namespace, pool)]:
            self.releases.pop(key).set()  # no daemon will unload them: deletion goes on

    async def wait_released(self, namespace: str, pool: str, adapter: str, timeout_s: float) -> bool:
        """Trigger the pool's reconcile and wait until a pass has unloaded `adapter` (being deleted) from every pod
        it observed; False after `timeout_s` or when the pool has no daemon. The unloads are the reconcile's, so
        one pass serves every adapter deleted together, and no call is made twice."""
        if not self.has_pool(namespace, pool):
            return False
        released = self.releases.setdefault((namespace, pool, adapter), asyncio.Event())
        self.trigger_adapter(namespace, pool, adapter)
        try:
            await asyncio.wait_for(released.wait(), timeout=timeout_s)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            if self.releases.get((namespace, pool, adapter)) is released:
                del self.releases[(namespace, pool, adapter)]

    def mark_released(self, namespace: str, pool: str, adapters: Iterable[str]) -> None:
        for adapter in adapters:
            event = self.releases.get((namespace, pool, adapter))
            if event is not None:
                event.set()

    async def close(self) -> None:
        await self.kube_session.close()
        await self.engine_session.close()
