"""Out-of-band changes reach the reconcile within a second: one long poll per ready engine pod.

Each watcher asks its pod `GET /v1/models?changed_since=<tag>` (the engine answers when its adapter set changes,
or after `wait_s` with the same tag) and triggers the pool's reconcile when the tag moves. So an adapter
unloaded, loaded or evicted behind the operator's back is repaired at once instead of at the next resync, and a
steady pod costs one open request per `wait_s`. The operator's own calls move the tag too; the reconcile that
follows finds nothing to do. An engine that tags nothing is not watched (the resync still covers it); an error
waits `RETRY_S` and starts over.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

from kubelora.operator.engine_client import EngineClient, EngineError

log = logging.getLogger("kubelora.operator")
WAIT_S = 55.0  # one open request per pod per WAIT_S when nothing changes
RETRY_S = 5.0  # after an error (a restarting pod), or an engine that answers without waiting
MIN_INTERVAL_S = 1.0  # an engine that ignores changed_since must not make this a busy loop


async def watch_pod(client: EngineClient, url: str, on_change: Callable[[], None], *, wait_s: float = WAIT_S) -> None:
    """Until cancelled: long-poll `url`, calling `on_change` whenever its adapter-set tag moves."""
    loop = asyncio.get_running_loop()
    tag: str | None = None
    while True:
        started = loop.time()
        try:
            new = await client.wait_for_change(url, tag, wait_s)
        except EngineError as exc:
            log.debug("watching %s: %s; retrying in %g s", url, exc, RETRY_S)
            tag = None
            await asyncio.sleep(RETRY_S)
            continue
        if new is None:
            log.info("%s does not tag its adapter set: not watched (the resync covers it)", url)
            return
        if tag is not None and new != tag:
            on_change()
        is_early = new == tag and loop.time() - started < MIN_INTERVAL_S
        tag = new
        if is_early:
            await asyncio.sleep(RETRY_S)


class PodWatchers:
    """The watchers of one pool, kept to its ready pods (and the admin token each answers to) after each pass."""

    def __init__(self, make_client: Callable[[str | None], EngineClient], on_change: Callable[[], None]) -> None:
        self._make_client, self._on_change = make_client, on_change
        self._tasks: dict[tuple[str, str | None], asyncio.Task] = {}  # (url, admin token) -> its watcher

    def update(self, tokens: Mapping[str, str | None]) -> None:
        """tokens: admin URL of each pod to watch -> the admin token that pod answers to."""
        wanted = set(tokens.items())
        for key in [k for k in self._tasks if k not in wanted]:
            self._tasks.pop(key).cancel()
        for key in wanted - set(self._tasks):
            url, token = key
            self._tasks[key] = asyncio.create_task(watch_pod(self._make_client(token), url, self._on_change),
                                                   name=f"kubelora-watch {url}")

    @property
    def urls(self) -> set[str]:
        return {url for url, _ in self._tasks}

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
