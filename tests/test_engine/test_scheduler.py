"""Scheduler units: plain Python, a fake adapter placer, no model."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from kubelora.engine.adapters.types import Residency
from kubelora.engine.block_manager import BlockManager, BlockManagerConfig
from kubelora.engine.errors import QueueFull
from kubelora.contract.errors import FailureKind
from kubelora.engine.sampling_params import SamplingParams
from kubelora.engine.scheduler import Scheduler, SchedulerConfig
from kubelora.engine.sequence import Sequence, SequenceStatus

_clock = itertools.count()


class FakePlacer:
    """Adapters are plain strings; `cold` ones are not resident; `errors` simulate failed loads."""

    def __init__(self, cold=()) -> None:
        self.cold = set(cold)
        self.errors: dict[str, str] = {}
        self.releases: Counter = Counter()

    def ensure_device(self, revision, protected) -> Residency:
        return Residency.LOADING if revision in self.cold else Residency.RESIDENT

    def take_load_error(self, revision):
        return self.errors.pop(revision, None)

    def release(self, revision) -> None:
        self.releases[revision] += 1

    def slot_view(self, revision):
        return revision


def make_scheduler(placer=None, num_blocks=4096, block_size=4, **limits) -> Scheduler:
    config = SchedulerConfig(**{"max_num_seqs": 16, "max_num_batched_tokens": 256, "max_loras": 2,
                                "max_waiting": 1000, **limits})
    return Scheduler(config, BlockManager(BlockManagerConfig(num_blocks, block_size)), placer or FakePlacer())


def make_seq(request_id: str, adapter: str | None, prompt_len: int = 4, max_tokens: int = 4) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Sequence(request_id=request_id, prompt_token_ids=[5] * prompt_len, params=params, adapter_name=adapter,
                    adapter=adapter, max_tokens=max_tokens, arrival_time=float(next(_clock)))


def run_step(scheduler: Scheduler):
    batch = scheduler.schedule()
    scheduler.postprocess(batch, [7 if c.is_sampled else None for c in batch.chunks])
    return batch


def adapters_in(batch) -> set:
    return {c.seq.adapter_name for c in batch.chunks if c.seq.adapter_name is not None}


def run_until_done(scheduler: Scheduler, max_steps: int = 1000) -> list:
    batches = []
    while scheduler.has_unfinished():
        batches.append(run_step(scheduler))
        assert len(batches) < max_steps, "scheduler made no progress"
    return batches


def test_max_loras_holds_with_many_adapters_plus_base_requests():
    placer = FakePlacer()
    scheduler = make_scheduler(placer, max_loras=2, max_num_seqs=32)
    for i in range(6):
        for j in range(3):
            scheduler.add(make_seq(f"a{i}-{j}", f"adapter-{i}"))
    for j in range(6):
        scheduler.add(make_seq(f"base-{j}", None))
    batches = run_until_done(scheduler)
    assert all(len(adapters_in(b)) <= 2 for b in batches)
    assert all(len(b.slots) <= 2 for b in batches)
    first = {c.seq.request_id for c in batches[0].chunks}
    assert {f"base-{j}" for j in range(6)} <= first, "base requests take no adapter slot and never wait for one"
    assert placer.releases == Counter({f"adapter-{i}": 3 for i in range(6)})


def test_slots_in_batch_match_chunks():
    scheduler = make_scheduler(max_loras=3)
    for name in ("x", None, "y", "x"):
        scheduler.add(make_seq(f"r-{next(_clock)}", name))
    batch = scheduler.schedule()
    for chunk in batch.chunks:
        if chunk.seq.adapter is None:
            assert chunk.slot == -1
        else:
            assert batch.slots[chunk.slot] == chunk.seq.adapter


def test_non_resident_adapter_waits_without_blocking_others():
    placer = FakePlacer(cold={"cold"})
    scheduler = make_scheduler(placer, max_loras=4)
    scheduler.add(make_seq("cold-1", "cold"))
    for i in range(3):
        scheduler.add(make_seq(f"warm-{i}", "warm" if i else None))
    batch = run_step(scheduler)
    ids = {c.seq.request_id for c in batch.chunks}
    assert ids == {"warm-0", "warm-1", "warm-2"}
    assert scheduler.get("cold-1").status is SequenceStatus.WAITING
    placer.cold.clear()
    assert "cold-1" in {c.seq.request_id for c in run_step(scheduler).chunks}


def _first_scheduled_step(scheduler: Scheduler, request_id: str, max_steps: int = 200) -> int:
    for step in range(1, max_steps):
        if request_id in {c.seq.request_id for c in run_step(scheduler).chunks}:
            return step
    raise AssertionError(f"{request_id} never scheduled")


@pytest.mark.parametrize("max_loras", [1, 2])
def test_trickling_adapter_has_bounded_wait_while_others_flood(max_loras):
    """`max_loras` adapters flood (far more requests than a batch holds) and hold every slot; another adapter
    trickles in. Each trickling request is scheduled within one request lifetime of the flooders (max_tokens
    steps), not after the flood drains (which takes hundreds of steps here)."""
    max_tokens = 6
    scheduler = make_scheduler(max_loras=max_loras, max_num_seqs=8)
    for i in range(120):
        for k in range(max_loras):
            scheduler.add(make_seq(f"flood{k}-{i}", f"flood-{k}", max_tokens=max_tokens))
    waits = []
    for i in range(5):
        for _ in range(7):
            run_step(scheduler)
        scheduler.add(make_seq(f"trickle-{i}", "trickle", max_tokens=2))
        waits.append(_first_scheduled_step(scheduler, f"trickle-{i}"))
    assert max(waits) <= max_tokens + 2, waits
    assert scheduler.get("flood0-119") is not None, "the flood is still queued: the bound is not the drain"


def test_equal_floods_share_tokens_fairly():
    scheduler = make_scheduler(max_loras=2, max_num_seqs=6)
    for i in range(60):
        for name in ("a", "b", "c"):
            scheduler.add(make_seq(f"{name}-{i}", name, prompt_len=8, max_tokens=4))
    tokens: Counter = Counter()
    for _ in range(120):
        for chunk in run_step(scheduler).chunks:
            tokens[chunk.seq.adapter_name] += len(chunk.token_ids)
    shares = [tokens[n] / sum(tokens.values()) for n in ("a", "b", "c")]
    assert min(shares) > 0.25, shares


@pytest.mark.parametrize("max_num_seqs", [8, 64])
def test_trickle_takes_the_next_free_sequence_slot(max_num_seqs):
    """With an adapter slot free, a trickling request is admitted as soon as a sequence slot is: at once when
    there is room, else when the first running request finishes (before the flooder's queued ones)."""
    scheduler = make_scheduler(max_loras=2, max_num_seqs=max_num_seqs)
    for i in range(50):
        scheduler.add(make_seq(f"flood-{i}", "flood", max_tokens=4))
    run_step(scheduler)
    scheduler.add(make_seq("t", "trickle"))
    assert _first_scheduled_step(scheduler, "t") == (1 if max_num_seqs > 50 else 4)


def test_queue_full_beyond_max_waiting():
    scheduler = make_scheduler(max_waiting=3)
    for i in range(3):
        scheduler.add(make_seq(f"r{i}", None))
    with pytest.raises(QueueFull) as info:
        scheduler.add(make_seq("r3", None))
    assert info.value.max_waiting == 3 and "max_waiting=3" in str(info.value)
    run_step(scheduler)  # admitted requests leave the waiting queue
    scheduler.add(make_seq("r3", None))


def test_chunked_prefill_splits_by_token_budget_and_samples_once():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add(make_seq("long", None, prompt_len=20, max_tokens=2))
    sizes, sampled = [], []
    for _ in range(4):
        batch = run_step(scheduler)
        sizes.append([len(c.token_ids) for c in batch.chunks])
        sampled.append([c.is_sampled for c in batch.chunks])
    assert sizes == [[8], [8], [4], [1]]
    assert sampled == [[False], [False], [True], [True]]
    assert not scheduler.has_unfinished()


def test_decodes_go_before_prefill_chunks():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add(make_seq("short", None, prompt_len=3, max_tokens=5))
    run_step(scheduler)
    scheduler.add(make_seq("long", None, prompt_len=30))
    batch = run_step(scheduler)
    assert [(c.seq.request_id, len(c.token_ids)) for c in batch.chunks] == [("short", 1), ("long", 7)]


def test_preemption_when_kv_blocks_run_out_still_finishes_everything():
    placer = FakePlacer()
    scheduler = make_scheduler(placer, num_blocks=10, block_size=4, max_num_seqs=8)
    for i in range(6):
        scheduler.add(make_seq(f"r{i}", "a" if i % 2 else None, prompt_len=6, max_tokens=10))
    run_until_done(scheduler)
    assert scheduler.num_preemptions > 0
    assert placer.releases == Counter({"a": 3})


def test_abort_releases_the_adapter_exactly_once():
    placer = FakePlacer()
    scheduler = make_scheduler(placer, max_num_seqs=1)
    scheduler.add(make_seq("running", "a", max_tokens=50))
    scheduler.add(make_seq("waiting", "a"))
    batch = scheduler.schedule()
    scheduler.abort("running")  # aborted while its step runs
    scheduler.abort("waiting")
    scheduler.abort("waiting")
    scheduler.postprocess(batch, [7])
    assert placer.releases == Counter({"a": 2})
    finished = scheduler.take_finished_between_steps()
    assert [s.status for s in finished] == [SequenceStatus.FINISHED_ABORTED] * 2
    assert not scheduler.has_unfinished()


def test_failed_adapter_load_fails_only_its_waiting_requests():
    placer = FakePlacer(cold={"bad"})
    scheduler = make_scheduler(placer)
    scheduler.add(make_seq("bad-1", "bad"))
    scheduler.add(make_seq("good-1", "good"))
    scheduler.add(make_seq("bad-2", "bad"))
    run_step(scheduler)
    placer.errors["bad"] = "adapter 'bad': adapter_model.safetensors: missing"
    batch = run_step(scheduler)
    failed = scheduler.take_finished_between_steps()
    assert {s.request_id for s in failed} == {"bad-1", "bad-2"}
    assert all(s.status is SequenceStatus.FINISHED_ERROR and "missing" in s.error for s in failed)
    assert all(s.error_kind is FailureKind.ADAPTER_LOAD for s in failed)
    assert "good-1" in {c.seq.request_id for c in batch.chunks}
    assert placer.releases["bad"] == 2


class FakePool(FakePlacer):
    """A device pool with room for `capacity` adapters; evicts only unprotected ones."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.resident: list = []

    def ensure_device(self, revision, protected) -> Residency:
        if revision in self.resident:
            return Residency.RESIDENT
        if len(self.resident) >= self.capacity:
            victim = next((r for r in self.resident if r not in protected), None)
            if victim is None:
                return Residency.NO_ROOM
            self.resident.remove(victim)
        self.resident.append(revision)
        return Residency.RESIDENT


def test_adapter_blocked_by_a_full_pool_has_a_bounded_wait():
    """The pool (not max_loras) is the limit: a flooding adapter fills it; the trickling one still gets in
    within one request lifetime, because the flooder stops admitting while it waits."""
    max_tokens = 5
    pool = FakePool(capacity=1)
    scheduler = make_scheduler(pool, max_loras=4, max_num_seqs=8)
    for i in range(100):
        scheduler.add(make_seq(f"flood-{i}", "flood", max_tokens=max_tokens))
    run_step(scheduler)
    scheduler.add(make_seq("trickle", "trickle", max_tokens=2))
    assert _first_scheduled_step(scheduler, "trickle") <= max_tokens + 1
    assert scheduler.get("flood-99") is not None


class BudgetPlacer(FakePlacer):
    """A device pool that holds `capacity` adapters: beyond it, NO_ROOM unless the adapter is already placed."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.placed: set = set()

    def ensure_device(self, revision, protected) -> Residency:
        if revision not in self.placed:
            if len(self.placed) >= self.capacity:
                self.placed &= set(protected)  # evict what no running request holds
            if len(self.placed) >= self.capacity:
                return Residency.NO_ROOM
            self.placed.add(revision)
        return Residency.RESIDENT


def test_without_a_count_limit_the_pool_decides_and_one_batch_takes_every_adapter():
    """64 requests over 32 adapters with room for all 32: one batch, no waves."""
    scheduler = make_scheduler(BudgetPlacer(capacity=32), max_loras=None, max_num_seqs=64,
                               max_num_batched_tokens=4096)
    names = [f"a{j}" for j in range(32)]
    for i in range(64):
        scheduler.add(make_seq(f"r{i}", names[i % 32]))
    first = run_step(scheduler)
    assert len(first.chunks) == 64 and len(adapters_in(first)) == 32


def test_without_a_count_limit_a_small_pool_runs_what_fits_and_finishes_everyone():
    placer = BudgetPlacer(capacity=8)
    scheduler = make_scheduler(placer, max_loras=None, max_num_seqs=64, max_num_batched_tokens=4096)
    for i in range(64):
        scheduler.add(make_seq(f"r{i}", f"a{i % 32}"))
    batches = run_until_done(scheduler)
    assert max(len(adapters_in(b)) for b in batches) == 8
    assert sum(placer.releases.values()) == 64


def _first_token_steps(scheduler: Scheduler, seqs: list) -> list[int]:
    firsts: dict[str, int] = {}
    step = 0
    while scheduler.has_unfinished():
        step += 1
        run_step(scheduler)
        for seq in seqs:
            if seq.output_token_ids and seq.request_id not in firsts:
                firsts[seq.request_id] = step
        assert step < 5000, "scheduler made no progress"
    return sorted(firsts[s.request_id] for s in seqs)


def test_adapters_beyond_the_pool_take_time_slices():
    """64 requests over 32 adapters, a pool for 8: every request's first token comes within a few slices,
    not after the waves of whole requests before it; every request finishes with all its tokens."""
    names = [f"a{j}" for j in range(32)]  # one object per adapter, as revisions are
    seqs = [make_seq(f"r{i}", names[i % 32], max_tokens=128) for i in range(64)]
    scheduler = make_scheduler(BudgetPlacer(capacity=8), max_loras=None, max_num_seqs=64,
                               max_num_batched_tokens=4096, lora_time_slice_steps=16)
    for seq in seqs:
        scheduler.add(seq)
    firsts = _first_token_steps(scheduler, seqs)
    assert firsts[-1] <= 3 * 16 + 2  # the 4th group of 8 adapters starts after 3 slices
    assert scheduler.num_pauses > 0
    assert all(len(s.output_token_ids) == 128 for s in seqs)

    waves = [make_seq(f"w{i}", names[i % 32], max_tokens=128) for i in range(64)]
    serial = make_scheduler(BudgetPlacer(capacity=8), max_loras=None, max_num_seqs=64, max_num_batched_tokens=4096,
                            lora_time_slice_steps=10_000)
    for seq in waves:
        serial.add(seq)
    assert _first_token_steps(serial, waves)[-1] > 3 * 128  # without slices: three whole waves first


def test_time_slices_do_not_start_without_pool_waiters():
    scheduler = make_scheduler(BudgetPlacer(capacity=8), max_loras=None, max_num_seqs=64,
                               lora_time_slice_steps=2)
    for i in range(16):
        scheduler.add(make_seq(f"r{i}", f"a{i % 8}", max_tokens=12))
    run_until_done(scheduler)
    assert scheduler.num_pauses == 0


def test_paused_requests_holding_every_kv_block_do_not_deadlock():
    """Time slices keep paused requests' KV caches; when those fill the cache and nothing runs, admission drops
    kept caches (counted as preemptions) instead of waiting for blocks that nobody will free."""
    names = [f"a{j}" for j in range(4)]
    seqs = [make_seq(f"r{i}", names[i % 4], prompt_len=8, max_tokens=12) for i in range(12)]
    scheduler = make_scheduler(BudgetPlacer(capacity=2), num_blocks=12, block_size=4, max_loras=None,
                               max_num_seqs=8, lora_time_slice_steps=3)
    for seq in seqs:
        scheduler.add(seq)
    _first_token_steps(scheduler, seqs)
    assert all(len(s.output_token_ids) == 12 for s in seqs)
    assert scheduler.num_pauses > 0 and scheduler.num_preemptions > 0


def test_an_adapter_that_went_idle_does_not_keep_its_old_counter():
    """Fairness counters belong to active keys: once an adapter's last request finishes, its next burst starts
    level with the others instead of waiting until they have caught up with its earlier tokens."""
    scheduler = make_scheduler(max_loras=1, max_num_seqs=4)
    for i in range(12):
        scheduler.add(make_seq(f"a{i}", "a", max_tokens=16))
    run_until_done(scheduler)
    for i in range(40):
        scheduler.add(make_seq(f"b{i}", "b", max_tokens=4))
    late = make_seq("a-late", "a", max_tokens=4)
    scheduler.add(late)
    step = 0
    while not late.output_token_ids:
        run_step(scheduler)
        step += 1
        assert step < 200
    assert step <= 2 * (4 + 1)  # behind b's first group at most (its requests' lifetime), not its whole burst
