"""Continuous batching with chunked prefill, at most `max_loras` distinct adapters per batch, fair admission.

Each step `schedule()` returns a `Batch`: first the running sequences (decodes, then prefill chunks), then
waiting ones admitted in fairness order (smallest virtual token counter first). A waiting request whose adapter
is not resident (the device pool has no room for it beside the running adapters), or that would need one more
adapter slot than `max_loras` where that count limit is set, is skipped and the scan goes on: it never blocks
requests of other adapters. Base-model requests take no adapter slot.

Anti-starvation: when a key is refused only for lack of a slot, keys behind it in fairness order stop admitting
new requests into the adapters they already run, so a slot frees as soon as those requests finish: a waiting
adapter gets in within one request lifetime (bounded by max_tokens) even when others flood.

Time slices: when requests wait because the device adapter pool has no room beside the running adapters, an
adapter that has run `lora_time_slice_steps` steps since it was admitted pauses: its requests go back to the
front of their queues with their KV cache kept, its pool room may be taken by a waiting adapter, and fairness
order brings it back. So adapters beyond the pool's room take turns instead of waiting for whole requests.

A scheduled batch counts as computed at once: `schedule()` advances each sequence's computed tokens and, for a
chunk that samples, adds one pending token; `postprocess` turns pending tokens into sampled ones. So the engine
may schedule (and launch) the next step while this one runs: a sequence's pending token is fed to that next step
from the device, and a sequence whose every remaining token is pending is not scheduled again.

Prefix caching (engine/block_manager.py): a request admitted without KV blocks (new, preempted, or paused and
dropped) first takes the cached blocks of its longest cached prefix of full blocks, never its last token (its
logits must be computed), and its first chunk starts at the first token after them; those blocks need no room.
Once a step is read back (`postprocess`), the full blocks it wrote are offered to the cache.
"""

from __future__ import annotations

import time
from collections import deque

from kubelora.engine.adapters.types import Residency
from kubelora.engine.batch import AdapterPlacer, Batch, ScheduledChunk, SchedulerConfig
from kubelora.engine.block_manager import BlockManager
from kubelora.contract.errors import FailureKind
from kubelora.engine.errors import QueueFull
from kubelora.engine.fairness import FairShare
from kubelora.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, adapters: AdapterPlacer) -> None:
        self.config = config
        self._blocks = blocks
        self._adapters = adapters
        self._waiting: dict[str, deque[Sequence]] = {}
        self._running: list[Sequence] = []  # admission order
        self._seqs: dict[str, Sequence] = {}
        self._fair = FairShare()
        self._num_waiting = 0
        self._finished_between_steps: list[Sequence] = []  # aborted or failed outside postprocess
        self.num_preemptions = 0
        self.num_pauses = 0
        self._num_steps = 0
        self._slice_start: dict[object, int] = {}  # adapter revision -> step its current time slice began
        # Prefix cache lookups at first admission, in prompt tokens, per adapter key ("" = base model):
        # (tokens looked up, tokens found cached).
        self.prefix_cache_tokens: dict[str, tuple[int, int]] = {}
        self._has_pool_waiters = False  # the last step refused a request for lack of pool room

    # ---- queues (under the engine lock) ----

    def has_room(self) -> bool:
        return self._num_waiting < self.config.max_waiting

    def add(self, seq: Sequence) -> None:
        if not self.has_room():
            raise QueueFull(self.config.max_waiting)
        key = seq.fairness_key
        if not self._is_active(key):
            self._fair.activate(key, self._active_keys())
        self._waiting.setdefault(key, deque()).append(seq)
        self._seqs[seq.request_id] = seq
        self._num_waiting += 1

    def abort(self, request_id: str) -> Sequence | None:
        seq = self._seqs.get(request_id)
        if seq is not None:
            self.finish(seq, SequenceStatus.FINISHED_ABORTED)
            self._finished_between_steps.append(seq)
        return seq

    def take_finished_between_steps(self) -> list[Sequence]:
        out, self._finished_between_steps = self._finished_between_steps, []
        return out

    def has_unfinished(self) -> bool:
        return bool(self._seqs) or bool(self._finished_between_steps)

    def get(self, request_id: str) -> Sequence | None:
        return self._seqs.get(request_id)

    def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """(running, waiting) request counts per adapter key ("" = base model)."""
        running: dict[str, int] = {}
        for seq in self._running:
            running[seq.fairness_key] = running.get(seq.fairness_key, 0) + 1
        waiting = {key: len(queue) for key, queue in self._waiting.items() if queue}
        return running, waiting

    # ---- one step ----

    def schedule(self) -> Batch:
        self._fail_failed_loads()
        self._num_steps += 1
        if self._has_pool_waiters:
            self._pause_expired_slices()
        self._has_pool_waiters = False
        budget = [self.config.max_num_batched_tokens]
        chunks: list[ScheduledChunk] = []
        self._schedule_running(budget, chunks)
        self._admit_waiting(budget, chunks)
        batch = self._build_batch(chunks)
        now = time.time()
        for chunk in batch.chunks:
            chunk.seq.first_scheduled_time = chunk.seq.first_scheduled_time or now
            chunk.seq.num_computed_tokens += len(chunk.token_ids)
            chunk.seq.num_pending += chunk.is_sampled
        return batch

    def schedule_alone(self, seq: Sequence) -> Batch:
        """A batch of one running sequence's next chunk (a request retried alone after a failed step); empty
        when it is not running or its KV blocks cannot grow."""
        if seq.status is not SequenceStatus.RUNNING:
            return Batch(chunks=(), slots=())
        num_new = min(seq.num_uncomputed_tokens, self.config.max_num_batched_tokens)
        if not self._grow_or_preempt(seq, num_new, {seq.request_id}):
            return Batch(chunks=(), slots=())
        batch = self._build_batch([self._chunk(seq, num_new, slot=-1)])
        seq.num_computed_tokens += num_new
        seq.num_pending += batch.chunks[0].is_sampled
        return batch

    def rollback(self, batch: Batch) -> None:
        """Undo what `schedule()` counted for a batch whose step failed before its tokens were read: its chunks
        are computed again by a later step (their KV blocks stay allocated and are overwritten then)."""
        for chunk in batch.chunks:
            seq = chunk.seq
            if not seq.status.is_finished:
                seq.num_computed_tokens -= len(chunk.token_ids)
                seq.num_pending -= chunk.is_sampled

    def postprocess(self, batch: Batch, sampled: list[int | None]) -> list[Sequence]:
        """Append each sampled chunk's token (its oldest pending one); finish on eos/stop ids/length.

        Returns the sequences that got a token this step (finished ones included)."""
        self._offer_to_cache(batch)
        updated = []
        now = time.time()
        for chunk, token in zip(batch.chunks, sampled):
            seq = chunk.seq
            if token is None or seq.status.is_finished:
                continue  # a chunk in the middle of a prefill, or aborted / stopped while the step ran
            seq.num_pending -= 1  # a preempted or paused sequence keeps its token: it is recomputed with it
            seq.output_token_ids.append(token)
            seq.first_token_time = seq.first_token_time or now
            status = self._stop_status(seq, token)
            if status is not None:
                self.finish(seq, status)
            updated.append(seq)
        return updated

    def finish(self, seq: Sequence, status: SequenceStatus, error: str | None = None,
               error_kind: FailureKind | None = None) -> None:
        """Idempotent; frees KV blocks and releases the adapter reference exactly once. FINISHED_ERROR comes
        with both `error` (what the client is told) and `error_kind`."""
        if seq.status.is_finished:
            if status is SequenceStatus.FINISHED_STOPPED and seq.status is SequenceStatus.FINISHED_LENGTH:
                seq.status = status  # a stop string completed by the last allowed token
            return
        if seq.status is SequenceStatus.WAITING:
            self._waiting[seq.fairness_key].remove(seq)
            self._num_waiting -= 1
            self._drop_empty(seq.fairness_key)
        else:
            self._running.remove(seq)
            if not self._is_active(seq.fairness_key):  # its counter must not outlive it (a later burst of it
                self._fair.forget(self._active_keys())  # would wait behind everyone for its earlier tokens)
        seq.status, seq.error, seq.error_kind = status, error, error_kind
        self._blocks.free(seq.request_id)
        self._seqs.pop(seq.request_id, None)
        if seq.adapter is not None:
            revision, seq.adapter = seq.adapter, None
            self._adapters.release(revision)

    # ---- internals ----

    def _schedule_running(self, budget: list[int], chunks: list[ScheduledChunk]) -> None:
        scheduled: set[str] = set()
        for seq in sorted(self._running, key=lambda s: s.is_prefill):  # decodes first
            if seq.status is not SequenceStatus.RUNNING or budget[0] == 0:
                continue
            if seq.num_pending and seq.num_output_tokens >= seq.max_tokens:
                continue  # its last token is in flight
            num_new = min(seq.num_uncomputed_tokens, budget[0])
            if not self._grow_or_preempt(seq, num_new, scheduled):
                continue
            chunks.append(self._chunk(seq, num_new, slot=-1))
            scheduled.add(seq.request_id)
            budget[0] -= num_new
            self._fair.charge(seq.fairness_key, num_new)

    def _grow_or_preempt(self, seq: Sequence, num_new: int, scheduled: set[str]) -> bool:
        while not self._blocks.grow(seq.request_id, seq.num_computed_tokens + num_new):
            victim = next((s for s in reversed(self._running) if s.request_id not in scheduled), None)
            if victim is None:
                return False
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _pause_expired_slices(self) -> None:
        """Requests of adapters whose time slice is over go back to the front of their queues, KV cache kept."""
        running = {s.adapter for s in self._running if s.adapter is not None}
        self._slice_start = {rev: start for rev, start in self._slice_start.items() if rev in running}
        expired = {rev for rev, start in self._slice_start.items()
                   if self._num_steps - start >= self.config.lora_time_slice_steps}
        for seq in reversed([s for s in self._running if s.adapter in expired]):
            self._running.remove(seq)
            seq.status = SequenceStatus.WAITING
            self._waiting.setdefault(seq.fairness_key, deque()).appendleft(seq)
            self._num_waiting += 1
            self.num_pauses += 1
        for revision in expired:
            del self._slice_start[revision]

    def _preempt(self, seq: Sequence) -> None:
        """Out of KV blocks: drop the sequence's cache and requeue it at the front (recomputed later)."""
        self._running.remove(seq)
        self._drop_cache(seq)
        seq.status = SequenceStatus.WAITING
        self._waiting.setdefault(seq.fairness_key, deque()).appendleft(seq)
        self._num_waiting += 1

    def _admit_waiting(self, budget: list[int], chunks: list[ScheduledChunk]) -> None:
        in_batch = {s.adapter for s in self._running if s.adapter is not None}
        refused: set[str] = set()
        has_slot_waiter = False
        while self._has_room(budget):
            key = self._next_key(refused)
            if key is None:
                return
            revision = self._waiting[key][0].adapter
            is_new_slot = revision is not None and revision not in in_batch
            if is_new_slot and self.config.max_loras is not None and len(in_batch) >= self.config.max_loras:
                refused.add(key)  # needs a slot: keys behind it must not hold theirs longer
                has_slot_waiter = True
                continue
            if revision is not None and not is_new_slot and has_slot_waiter:
                refused.add(key)  # let this adapter drain so the slot waiter gets in
                continue
            residency = Residency.RESIDENT if revision is None else \
                self._adapters.ensure_device(revision, protected=set(in_batch))
            if residency is not Residency.RESIDENT:
                refused.add(key)  # loading or no room: wait without blocking the others
                has_slot_waiter |= residency is Residency.NO_ROOM  # pool full of running adapters: drain them
                self._has_pool_waiters |= residency is Residency.NO_ROOM
                continue
            # A new slot admits a group of the adapter's queued requests at once: they run together and the
            # adapter is not swapped in again for each of them.
            if not self._admit_from(key, budget, chunks, self._grant_size if is_new_slot else 1):
                return  # out of KV blocks: nothing else fits either
            if revision is not None:
                in_batch.add(revision)
                if is_new_slot:
                    self._slice_start[revision] = self._num_steps

    def _admit_from(self, key: str, budget: list[int], chunks: list[ScheduledChunk], limit: int) -> int:
        """Admit up to `limit` requests from the head of one key's queue that share the head's revision."""
        queue = self._waiting[key]
        revision = queue[0].adapter
        count = 0
        while count < limit and queue and queue[0].adapter is revision and self._has_room(budget):
            seq = queue[0]
            num_cached = self._take_cached_prefix(seq)
            num_new = min(seq.num_uncomputed_tokens, budget[0])
            if not self._grow_admitted(seq, seq.num_computed_tokens + num_new):
                if num_cached:  # the cached blocks go back (still cached) until it is admitted
                    self._blocks.free(seq.request_id)
                    seq.num_computed_tokens = 0
                break
            if seq.num_cached_tokens is None:
                self._count_prefix_lookup(seq, num_cached)
            queue.popleft()
            self._num_waiting -= 1
            seq.status = SequenceStatus.RUNNING
            self._running.append(seq)
            chunks.append(self._chunk(seq, num_new, slot=-1))
            budget[0] -= num_new
            self._fair.charge(key, num_new)
            count += 1
        self._drop_empty(key)
        return count

    def _grow_admitted(self, seq: Sequence, num_tokens: int) -> bool:
        """KV blocks for a request being admitted. With nothing running, no finishing request will free blocks:
        paused requests' kept caches (time slices) are dropped then, the latest arrival first, or every waiting
        request could hold blocks and wait for more forever."""
        while not self._blocks.grow(seq.request_id, num_tokens):
            if self._running:
                return False
            kept = [s for q in self._waiting.values() for s in q if s is not seq and s.num_computed_tokens]
            if not kept:
                return False
            self._drop_cache(max(kept, key=lambda s: s.arrival_time))
        return True

    def _take_cached_prefix(self, seq: Sequence) -> int:
        """A sequence without KV blocks takes its cached prefix (full blocks, never its last token) as computed;
        returns its length in tokens."""
        if seq.num_computed_tokens or not seq.reads_cache or self._blocks.table(seq.request_id):
            return 0
        block_size = self._blocks.block_size
        keys = seq.full_block_keys(block_size)[:(seq.num_tokens - 1) // block_size]
        seq.num_computed_tokens = self._blocks.take_cached(seq.request_id, keys) * block_size
        return seq.num_computed_tokens

    def _count_prefix_lookup(self, seq: Sequence, num_cached: int) -> None:
        seq.num_cached_tokens = num_cached
        if seq.reads_cache:
            queries, hits = self.prefix_cache_tokens.get(seq.fairness_key, (0, 0))
            self.prefix_cache_tokens[seq.fairness_key] = (queries + len(seq.prompt_token_ids), hits + num_cached)

    def _offer_to_cache(self, batch: Batch) -> None:
        """The full blocks a read-back step wrote become cached (their tokens are all known now)."""
        block_size = self._blocks.block_size
        for chunk in batch.chunks:
            seq = chunk.seq
            if seq.cache_root is None or seq.status.is_finished:
                continue
            num_full = (chunk.start_pos + len(chunk.token_ids)) // block_size
            if num_full:
                self._blocks.cache(seq.request_id, chunk.block_table, seq.full_block_keys(block_size), num_full,
                                   seq.adapter)

    def _drop_cache(self, seq: Sequence) -> None:
        """A waiting request's kept KV cache is freed; it is recomputed when admitted (counted as a preemption)."""
        self._blocks.free(seq.request_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1

    def _has_room(self, budget: list[int]) -> bool:
        return budget[0] > 0 and len(self._running) < self.config.max_num_seqs

    @property
    def _grant_size(self) -> int:
        """Requests a new adapter admits at once: its share of the batch under a count limit, else all that fit."""
        if self.config.max_loras is None:
            return self.config.max_num_seqs
        return max(1, self.config.max_num_seqs // self.config.max_loras)

    def _next_key(self, refused: set[str]) -> str | None:
        candidates = [k for k, q in self._waiting.items() if q and k not in refused]
        if not candidates:
            return None
        return min(candidates, key=lambda k: (self._fair.counter(k), self._waiting[k][0].arrival_time))

    def _chunk(self, seq: Sequence, num_new: int, slot: int) -> ScheduledChunk:
        start = seq.num_computed_tokens
        return ScheduledChunk(
            seq=seq,
            token_ids=tuple(seq.token_ids(start, start + num_new)),
            start_pos=start,
            block_table=tuple(self._blocks.table(seq.request_id)),
            slot=slot,
            is_sampled=start + num_new == seq.num_tokens,
        )

    def _build_batch(self, chunks: list[ScheduledChunk]) -> Batch:
        """Assign step slots to the distinct adapters, after every placement (addresses are now final)."""
        slot_of: dict[object, int] = {}
        out = []
        for chunk in chunks:
            revision = chunk.seq.adapter
            slot = -1 if revision is None else slot_of.setdefault(revision, len(slot_of))
            out.append(ScheduledChunk(chunk.seq, chunk.token_ids, chunk.start_pos, chunk.block_table, slot,
                                      chunk.is_sampled))
        slots = tuple(self._adapters.slot_view(revision) for revision in slot_of)
        return Batch(chunks=tuple(out), slots=slots)

    def _fail_failed_loads(self) -> None:
        """Requests waiting for an adapter whose on-demand load failed finish with that error."""
        errors: dict[object, str | None] = {}
        for seq in [s for queue in self._waiting.values() for s in queue if s.adapter is not None]:
            if seq.adapter not in errors:
                errors[seq.adapter] = self._adapters.take_load_error(seq.adapter)
            if errors[seq.adapter] is not None:
                self.finish(seq, SequenceStatus.FINISHED_ERROR, errors[seq.adapter], FailureKind.ADAPTER_LOAD)
                self._finished_between_steps.append(seq)

    def _stop_status(self, seq: Sequence, token: int) -> SequenceStatus | None:
        if not seq.params.ignore_eos and token in self.config.eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if token in seq.params.stop_token_id_set:
            return SequenceStatus.FINISHED_STOPPED
        if len(seq.output_token_ids) >= seq.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _drop_empty(self, key: str) -> None:
        if not self._waiting[key]:
            del self._waiting[key]
            if not self._is_active(key):
                self._fair.forget(self._active_keys())

    def _is_active(self, key: str) -> bool:
        return bool(self._waiting.get(key)) or any(s.fairness_key == key for s in self._running)

    def _active_keys(self) -> set[str]:
        return {k for k, q in self._waiting.items() if q} | {s.fairness_key for s in self._running}
