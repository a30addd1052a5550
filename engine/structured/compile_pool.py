"""Grammar compiles on threads, each under a deadline, with bounded room: one request's grammar cannot hold the
others' up.

xgrammar's compile is one C++ call that cannot be interrupted (two 80-byte JSON-schema `pattern`s took 34-38 s).
Each compile runs on a thread of its own; `limits.max_running` of them at a time, the rest wait in a queue. A
compile still running `limits.timeout_s` after it started is abandoned: its requests fail at once (400
`grammar_compile_timeout`), its thread runs on to the end and leaves its grammar in the cache, and its running slot
goes to the next compile. While `limits.max_abandoned` abandoned compiles still run, or `limits.max_queued` wait,
new compiles are refused (503, Retry-After). A compile that waited longer than `limits.max_wait_s` for a slot fails
its requests with the same 503: the grammar was never tried. Requests for a spec already compiling share its one
compile; a spec whose compile was abandoned fails at once until that compile ends.
"""

from __future__ import annotations

import enum
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from itertools import count

from kubelora.contract.errors import InvalidRequest, Unavailable
from kubelora.engine.structured.spec import StructuredOutput


@dataclass(frozen=True)
class CompileLimits:
    timeout_s: float = 10.0  # one compile, from its start
    max_wait_s: float = 20.0  # in the queue for a running slot (each slot frees within timeout_s)
    max_running: int = 2  # compiles within their deadline at once
    max_abandoned: int = 4  # compiles past their deadline that still run
    max_queued: int = 64  # compiles waiting for a thread

    def __post_init__(self) -> None:
        for name in ("timeout_s", "max_wait_s"):
            if not 0 < getattr(self, name) <= 3600:
                raise ValueError(f"{name} must be in (0, 3600], got {getattr(self, name)}")
        for name in ("max_running", "max_abandoned", "max_queued"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class JobState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    ABANDONED = "abandoned"  # past its deadline; its requests have failed, its thread still compiles


@dataclass
class _Job:
    spec: StructuredOutput
    queued_at: float
    waiters: list[tuple[Future, StructuredOutput]] = field(default_factory=list)
    state: JobState = JobState.QUEUED
    timer: threading.Timer | None = None


class CompilePool:
    """`submit(spec)` -> a future of `spec` with its grammar; `compile(spec)` (blocking) does the work."""

    def __init__(self, compile: Callable[[StructuredOutput], object], limits: CompileLimits) -> None:
        self._compile = compile
        self.limits = limits
        self._lock = threading.Lock()
        self._jobs: dict[tuple[str, str], _Job] = {}  # by spec key: queued, running and abandoned
        self._queue: deque[_Job] = deque()
        self._num_running = 0
        self._num_abandoned = 0
        self._names = count()
        self._is_closed = False

    def submit(self, spec: StructuredOutput) -> Future:
        """Raises Unavailable (503) when there is no room; the future fails with InvalidRequest (400) when the
        spec does not compile or its compile passes the deadline."""
        future: Future = Future()
        future.set_running_or_notify_cancel()  # completed by the pool only; a waiter that leaves just drops it
        with self._lock:
            job = self._jobs.get(spec.key)
            if job is not None and job.state is JobState.ABANDONED:
                raise self._timeout_error(spec)
            if job is None:
                self._check_room()
                job = self._jobs[spec.key] = _Job(spec, time.monotonic())
                self._queue.append(job)
            job.waiters.append((future, spec))
            self._dispatch()
        return future

    def close(self) -> None:
        with self._lock:
            self._is_closed = True
            while self._queue:
                self._settle(self._queue.popleft(), error=Unavailable("the engine is shutting down",
                                                                      code="engine_stopped"))

    def _check_room(self) -> None:
        limits = self.limits
        if self._is_closed:
            raise Unavailable("the engine is shutting down", code="engine_stopped")
        if self._num_abandoned >= limits.max_abandoned or len(self._queue) >= limits.max_queued:
            raise self._busy_error()

    def _dispatch(self) -> None:
        """Start queued compiles while there is a free slot (under the lock)."""
        while self._queue and self._num_running < self.limits.max_running:
            job = self._queue.popleft()
            if time.monotonic() - job.queued_at > self.limits.max_wait_s:
                self._settle(job, error=self._busy_error())
                continue
            job.state = JobState.RUNNING
            self._num_running += 1
            threading.Thread(target=self._run, args=(job,), name=f"kubelora-grammar-{next(self._names)}",
                             daemon=True).start()

    def arm(self, spec: StructuredOutput) -> None:
        """Start `spec`'s deadline; its thread calls this once the work that must not count (the tokenizer's
        vocabulary, indexed at the first compile) is done."""
        with self._lock:
            job = self._jobs.get(spec.key)
            if job is not None and job.state is JobState.RUNNING and job.timer is None:
                job.timer = threading.Timer(self.limits.timeout_s, self._expire, (job,))
                job.timer.daemon = True
                job.timer.start()

    def _run(self, job: _Job) -> None:
        try:
            grammar = self._compile(job.spec)
        except Exception as exc:  # noqa: BLE001 - handed to the requests that wait for it
            self._finish(job, None, exc)
        else:
            self._finish(job, grammar, None)

    def _expire(self, job: _Job) -> None:
        with self._lock:
            if job.state is not JobState.RUNNING:
                return
            job.state = JobState.ABANDONED
            self._num_running -= 1
            self._num_abandoned += 1
            self._settle(job, error=self._timeout_error(job.spec), forget=False)
            self._dispatch()

    def _finish(self, job: _Job, grammar: object, error: Exception | None) -> None:
        with self._lock:
            if job.timer is not None:
                job.timer.cancel()
            if job.state is JobState.RUNNING:
                self._num_running -= 1
                self._settle(job, grammar, error)
            else:
                self._num_abandoned -= 1
                self._jobs.pop(job.spec.key, None)
            self._dispatch()

    def _settle(self, job: _Job, grammar: object = None, error: Exception | None = None, *,
                forget: bool = True) -> None:
        """Complete every request waiting for `job` (under the lock); forget: drop the job."""
        for future, spec in job.waiters:
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(spec.with_grammar(grammar))
        job.waiters.clear()
        if forget:
            self._jobs.pop(job.spec.key, None)

    def _timeout_error(self, spec: StructuredOutput) -> InvalidRequest:
        return InvalidRequest(f"'{spec.param}' did not compile within {self.limits.timeout_s:g} s; simplify it (a "
                              "regex `pattern` with nested repetitions grows fastest)", param=spec.param,
                              code="grammar_compile_timeout")

    def _busy_error(self) -> Unavailable:
        retry_after = str(max(1, math.ceil(self.limits.timeout_s)))  # the longest a running slot stays taken
        return Unavailable(f"every grammar compile slot is busy (at most {self.limits.max_running} running, "
                           f"{self.limits.max_queued} waiting and {self.limits.max_abandoned} past their deadline); "
                           "retry later", param=None, code="grammar_compilers_busy",
                           headers={"Retry-After": retry_after})
