"""What the kopf handlers share in one operator process: clients, settings and per-pool triggers."""

from __future__ import annotations

import asyncio
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

    def trigger_for(self, namespace: str, pool: str) -> asyncio.Event:
        return self.triggers.setdefault((namespace, pool), asyncio.Event())

    def trigger(self, namespace: str, pool: str) -> None:
        """Ask the pool's reconcile daemon for a run now (no-op for a pool without a daemon yet)."""
        event = self.triggers.get((namespace, pool))
        if event is not None:
            event.set()

    def has_pool(self, namespace: str, pool: str) -> bool:
        return (namespace, pool) in self.triggers

    def forget(self, namespace: str, pool: str) -> None:
        self.triggers.pop((namespace, pool), None)

    async def close(self) -> None:
        await self.kube_session.close()
        await self.engine_session.close()
