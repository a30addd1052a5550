"""`PoolReconciler` that tells `OperatorMetrics` what each pass did: its duration and outcome, whether it was a whole
pass, every engine call, a new placement, and the adapters' and pool's statuses as the pass writes them.

Each hook wraps the one step of the pass that holds the fact (reconcile.py's `_fetch`, `_execute`, `_publish`,
`_patch_adapters`, `_patch_pool`) and leaves the decision and the writes to the parent.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from kubelora.operator.metrics import METRICS, OperatorMetrics
from kubelora.operator.plan import Unload
from kubelora.operator.reconcile import PoolReconciler


class MeteredReconciler(PoolReconciler):
    def __init__(self, *args, metrics: OperatorMetrics = METRICS, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.metrics = metrics
        # adapter -> its status as the last pass that decided for it computed it: a pass for changed adapters
        # computes theirs only (decide.Change)
        self._statuses: dict[str, Mapping] = {}

    async def reconcile(self, changed: frozenset[str] | None = None) -> None:
        start, is_error = time.monotonic(), True
        try:
            await super().reconcile(changed)
            is_error = False
        finally:
            self.metrics.record_pass(self.namespace, self.name, time.monotonic() - start, is_error)

    async def _fetch(self, body: dict, pool):
        self.metrics.record_whole_pass(self.namespace, self.name)
        return await super()._fetch(body, pool)

    async def _execute(self, plan, clients, view):
        results = await super()._execute(plan, clients, view)
        for result in results:
            call = "unload" if isinstance(result.action, Unload) else "load"
            self.metrics.record_call(self.namespace, self.name, call, result.error is not None)
        return results

    async def _publish(self, pool, body: dict, placement: dict | None) -> None:
        await super()._publish(pool, body, placement)
        if placement is not None:
            self.metrics.record_placement_change(self.namespace, self.name)

    async def _patch_adapters(self, bodies: Mapping[str, dict], report) -> None:
        self._statuses = {name: status for name, status in self._statuses.items()
                          if name in bodies and not bodies[name]["metadata"].get("deletionTimestamp")}
        self._statuses.update(report.adapter_statuses)
        self.metrics.record_adapters(self.namespace, self.name, self._statuses.values())
        await super()._patch_adapters(bodies, report)

    async def _patch_pool(self, body: dict, new: dict) -> None:
        self.metrics.record_pool(self.namespace, self.name, new)
        await super()._patch_pool(body, new)
