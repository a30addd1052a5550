"""Adapter loads and unloads as tasks of their own: one at a time per adapter name, never waiting on another.

A load fetches and reads files (seconds to minutes, up to the download deadline) on the admin pool; an unload
only flips state, on a thread of its own. Operations on one name run in the order they arrived, so an unload
waits for a load of its own name and for nothing else: not for loads of other adapters that fill the admin
pool. Each operation is a task that handlers await through `asyncio.shield`: a client that gives up does not
cancel it, and the callbacks its caller attached still record and log its outcome.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
NUM_LOAD_THREADS = 4


class AdapterOps:
    def __init__(self) -> None:
        self._load_pool = ThreadPoolExecutor(NUM_LOAD_THREADS, "kubelora-admin")
        self._unload_pool = ThreadPoolExecutor(1, "kubelora-unload")
        self._last: dict[str, asyncio.Future] = {}  # the latest operation per name; only touched on the loop

    def load(self, name: str, fn: Callable[..., T], *args: Any) -> asyncio.Task[T]:
        """`fn(*args)` on the admin pool, after the operations already submitted for `name`."""
        return self._submit(name, self._load_pool, fn, args)

    def unload(self, name: str, fn: Callable[..., T], *args: Any) -> asyncio.Task[T]:
        """`fn(*args)` on the unload thread, after the operations already submitted for `name`."""
        return self._submit(name, self._unload_pool, fn, args)

    def shutdown(self) -> None:
        for pool in (self._load_pool, self._unload_pool):
            pool.shutdown(wait=False, cancel_futures=True)

    def _submit(self, name: str, pool: ThreadPoolExecutor, fn: Callable[..., T], args: tuple) -> asyncio.Task[T]:
        task = asyncio.ensure_future(self._run_after(self._last.get(name), pool, fn, args))
        self._last[name] = task
        task.add_done_callback(lambda done: self._forget(name, done))
        return task

    @staticmethod
    async def _run_after(previous: asyncio.Future | None, pool: ThreadPoolExecutor, fn: Callable[..., T],
                         args: tuple) -> T:
        if previous is not None:
            await asyncio.wait([previous])  # its outcome belongs to its own caller
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def _forget(self, name: str, task: asyncio.Future) -> None:
        if self._last.get(name) is task:
            del self._last[name]
        if not task.cancelled():
            task.exception()  # retrieved: the caller's callbacks report it, asyncio need not
