"""The bridge between the asyncio server and the engine: one engine thread, per-HTTP-request output queues.

The engine thread calls `LLMEngine.step()` while work exists and hands each step's outputs to the event loop
with `call_soon_threadsafe`; the loop routes them to the queue of the HTTP request that owns them. Adding and
aborting happen on the loop (both take the engine's scheduler lock only briefly, never across a forward
pass). Adapter I/O never happens here: the adapter manager's loader threads load `known` adapters on demand.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kubelora.contract.errors import InvalidRequest, Unavailable
from kubelora.contract.logs import log_event
from kubelora.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # the engine's public names; no import cost at runtime
    from kubelora.engine import EngineSnapshot, RequestOutput

log = logging.getLogger("kubelora.engine.server")
IDLE_WAIT_S = 0.2  # the engine thread re-checks for shutdown this often while idle
GRAPH_POLL_S = 0.05


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: str | None
    cache_salt: str | None = None


class EngineStopped(Exception):
    """Put on every open queue when the engine thread ends: shutdown, or an exception out of `step()`, which
    contains one request's faults itself (that request alone finishes with "error") and raises only when the
    device is unusable."""


class RequestGroup:
    """The engine requests of one HTTP request; their outputs arrive on one queue, in step order."""

    def __init__(self, engine: AsyncEngine, request_ids: list[str], queue: asyncio.Queue) -> None:
        self._engine = engine
        self.request_ids = request_ids
        self._queue = queue
        self._unfinished = set(request_ids)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while self._unfinished:
            item = await self._queue.get()
            if isinstance(item, EngineStopped):
                raise Unavailable("the engine stopped while serving this request", code="engine_stopped")
            if item.finished:
                self._unfinished.discard(item.request_id)
            yield item

    def close(self) -> None:
        """Abort what has not finished (client gone, handler cancelled); safe to call twice."""
        for request_id in self._unfinished:
            self._engine.abort(request_id)
        self._unfinished.clear()


class AsyncEngine:
    def __init__(self, engine, on_finished: Callable[[RequestOutput], None] | None = None) -> None:
        self._engine = engine
        self._on_finished = on_finished
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.failure: BaseException | None = None  # set when step() raised: the engine is dead

    @property
    def is_running(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()
                and self.failure is None)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kubelora-engine", daemon=True)
        self._thread.start()

    async def wait_for_graphs(self, timeout_s: float) -> int:
        """Wait (up to timeout_s) until the engine thread has captured the decode graphs and run the prefill
        kernels the registered adapters need (start-up: /ready waits for them); returns how many are still missing."""
        deadline = time.monotonic() + timeout_s
        while ((pending := len(self._engine.pending_graphs()) + len(self._engine.pending_warm_ups()))
               and time.monotonic() < deadline and self.is_running):
            await asyncio.sleep(GRAPH_POLL_S)
        return pending

    async def stop(self) -> None:
        """Stop the engine thread; open requests see EngineStopped."""
        self._stopping.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self._fail_all()

    def submit(self, requests: list[EngineRequest]) -> RequestGroup:
        """Add every request or none: an engine error (QueueFull, UnknownAdapter...) aborts the ones added."""
        if not self.is_running:
            raise Unavailable("the engine is not running", code="engine_not_ready")
        max_waiting = self._engine.config.max_waiting
        if len(requests) > max_waiting:  # a 429 would say "retry later", and no retry can ever succeed
            raise InvalidRequest(f"'prompt' makes {len(requests)} sequences; the waiting queue holds at most "
                                 f"{max_waiting} (--max-waiting-requests)", param="prompt", code="out_of_range")
        queue: asyncio.Queue = asyncio.Queue()
        added: list[str] = []
        try:
            for r in requests:
                self._queues[r.request_id] = queue
                self._engine.add_request(r.request_id, r.prompt_token_ids, r.params, r.adapter, time.time(),
                                         cache_salt=r.cache_salt)
                added.append(r.request_id)
        except BaseException:
            for r in requests:
                self._queues.pop(r.request_id, None)
            for request_id in added:
                self._engine.abort_request(request_id)
            raise
        return RequestGroup(self, added, queue)

    @property
    def grammars(self):
        """The engine's grammar compiler (structured output); its pool compiles at admission, off the loop."""
        return self._engine.grammars

    def snapshot(self) -> EngineSnapshot:
        return self._engine.snapshot()

    def close(self) -> None:
        """Free the engine's resources (adapter loader threads) once `stop` has returned."""
        self._engine.close()

    def abort(self, request_id: str) -> None:
        # The queue stays registered until the "abort" output arrives, so metrics still see it finish.
        self._engine.abort_request(request_id)

    def _run(self) -> None:
        log_event(log, "engine_thread_started")
        try:
            has_captures = True
            while not self._stopping.is_set():
                if not self._engine.wait_for_work(0.0 if has_captures else IDLE_WAIT_S):
                    # Idle: capture the decode graphs the registered adapters will need, a bounded slice at a time.
                    has_captures = self._engine.capture_pending_graphs()
                    continue
                outputs = self._engine.step()
                if outputs:
                    self._loop.call_soon_threadsafe(self._deliver, outputs)
        except BaseException as exc:  # noqa: BLE001 - the device is gone (or a bug): report, fail open requests, stop
            self.failure = exc
            log.exception("engine step failed; the engine is stopped")
            self._loop.call_soon_threadsafe(self._fail_all)
        finally:
            log_event(log, "engine_thread_stopped", is_failure=self.failure is not None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            queue = self._queues.get(output.request_id)
            if output.finished:
                self._queues.pop(output.request_id, None)
                log_event(log, "request_finished", logging.DEBUG, request_id=output.request_id,
                          adapter=output.adapter, finish_reason=output.finish_reason,
                          num_prompt_tokens=output.num_prompt_tokens, num_generated_tokens=len(output.token_ids))
                if self._on_finished is not None:
                    self._on_finished(output)
            if queue is not None:
                queue.put_nowait(output)

    def _fail_all(self) -> None:
        queues = {id(q): q for q in self._queues.values()}
        self._queues.clear()
        for queue in queues.values():
            queue.put_nowait(EngineStopped())
