"""Block manager and block keys of the prefix cache: plain Python, no model."""

from __future__ import annotations

import pytest

from kubelora.engine.block_manager import BlockManager, BlockManagerConfig
from kubelora.engine.prefix_key import block_key, root_key
from kubelora.engine.sampling_params import SamplingParams
from kubelora.engine.scheduler import Scheduler, SchedulerConfig
from kubelora.engine.sequence import Sequence

BASE = root_key(None, None, None)


def chain(root: bytes, tokens: list[int], block_size: int = 2) -> list[bytes]:
    keys, parent = [], root
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_key(parent, tokens[start:start + block_size])
        keys.append(parent)
    return keys


def test_root_keys_differ_by_every_part_and_by_kind():
    roots = [
        BASE,
        root_key("a", "rev1", None), root_key("a", "rev2", None), root_key("b", "rev1", None),
        root_key(None, None, "a"), root_key(None, None, "rev1"), root_key("a", "rev1", "s"),
        root_key(None, None, ""), root_key("a", "rev1", ""),
        root_key("ab", "c", None), root_key("a", "bc", None),  # a length-prefixed encoding: no shifted boundary
    ]
    assert len(set(roots)) == len(roots)
    assert root_key("a", "rev1", "s") == root_key("a", "rev1", "s") and len(BASE) == 32
    with pytest.raises(ValueError, match="content revision"):
        root_key("a", None, None)


def test_block_keys_chain_their_parent():
    keys = chain(BASE, [1, 2, 3, 4, 5, 6])
    assert keys == chain(BASE, [1, 2, 3, 4, 5, 6, 7])  # a partial block has no key
    assert chain(BASE, [9, 2, 3, 4])[1] != keys[1]  # same tokens after another prefix: another key
    assert chain(root_key("a", "r", None), [1, 2, 3, 4]) != keys[:2]
    assert block_key(BASE, [1, 2]) != block_key(BASE, [1, 2, 0]) and block_key(BASE, [258]) != block_key(BASE, [2, 1])


def test_refcounts_share_cached_blocks_and_free_them_last():
    blocks = BlockManager(BlockManagerConfig(num_blocks=6, block_size=2))
    keys = chain(BASE, [1, 2, 3, 4, 5, 6])
    assert blocks.grow("a", 6) and blocks.table("a") == [0, 1, 2]
    blocks.cache("a", (0, 1, 2), keys, 3, adapter=None)
    assert blocks.num_cached == 3 and blocks.num_free == 3
    assert blocks.take_cached("b", keys[:2]) == 2 and blocks.table("b") == [0, 1]
    assert blocks.num_free == 3  # shared blocks take no room
    blocks.free("a")
    assert blocks.num_free == 4  # block 2 is cached and unused; 0 and 1 are still b's
    assert blocks.take_cached("c", keys) == 3 and blocks.num_free == 3
    blocks.free("b"), blocks.free("c")
    assert blocks.num_free == 6 and blocks.num_cached == 3 and blocks.usage == 0.0


def test_a_sequence_takes_the_longest_cached_prefix_only():
    blocks = BlockManager(BlockManagerConfig(num_blocks=8, block_size=2))
    keys = chain(BASE, [1, 2, 3, 4, 5, 6])
    assert blocks.grow("a", 6)
    blocks.cache("a", tuple(blocks.table("a")), keys, len(keys), adapter=None)
    other = chain(BASE, [1, 2, 9, 9, 5, 6])
    assert blocks.take_cached("b", other) == 1  # the third block's key chains a parent nobody cached
    with pytest.raises(RuntimeError, match="already holds"):
        blocks.take_cached("b", other)


def test_lru_evicts_the_least_recently_released_and_a_sequence_last_block_first():
    blocks = BlockManager(BlockManagerConfig(num_blocks=4, block_size=1))
    a, b = chain(BASE, [1, 2], 1), chain(BASE, [3, 4], 1)
    for seq_id, keys in (("a", a), ("b", b)):
        assert blocks.grow(seq_id, 2)
        blocks.cache(seq_id, tuple(blocks.table(seq_id)), keys, 2, adapter=None)
    blocks.free("a"), blocks.free("b")
    assert blocks.num_free == 4 and blocks.num_cached == 4
    assert blocks.grow("c", 1)  # the free list is empty: a's last block goes first
    assert blocks.table("c") == [1] and blocks.num_cached == 3
    assert blocks.take_cached("a2", a) == 1
    assert blocks.grow("d", 2) and blocks.table("d") == [3, 2]  # then b's, last first; a's first is in use
    assert not blocks.grow("e", 1)  # nothing left: a2 holds its block
    blocks.free("a2")
    assert blocks.grow("e", 1) and blocks.num_cached == 0


def test_cache_skips_blocks_a_sequence_no_longer_holds_and_keys_cached_elsewhere():
    blocks = BlockManager(BlockManagerConfig(num_blocks=8, block_size=2))
    keys = chain(BASE, [1, 2, 3, 4])
    assert blocks.grow("a", 4)
    step_table = tuple(blocks.table("a"))
    blocks.free("a")  # preempted while its step ran
    blocks.cache("a", step_table, keys, 2, adapter=None)
    assert blocks.num_cached == 0
    assert blocks.grow("x", 2) and blocks.grow("a", 4)  # re-admitted into other blocks
    blocks.cache("a", step_table, keys, 2, adapter=None)
    assert blocks.num_cached == 0
    blocks.cache("a", tuple(blocks.table("a")), keys, len(keys), adapter=None)
    assert blocks.num_cached == 2
    assert blocks.grow("b", 4)  # the same prefix computed again beside it: the first copy stays the cached one
    blocks.cache("b", tuple(blocks.table("b")), keys, 2, adapter=None)
    assert blocks.num_cached == 2
    blocks.free("b")
    assert blocks.num_free == 8 - 2 - 1


def test_drop_uncaches_one_adapters_blocks():
    blocks = BlockManager(BlockManagerConfig(num_blocks=8, block_size=2))
    old, new = object(), object()
    for seq_id, adapter, root in (("a", old, root_key("t", "r1", None)), ("b", new, root_key("t", "r2", None))):
        assert blocks.grow(seq_id, 4)
        blocks.cache(seq_id, tuple(blocks.table(seq_id)), chain(root, [1, 2, 3, 4]), 2, adapter=adapter)
    blocks.free("a")
    assert blocks.drop(old) == 2 and blocks.num_cached == 2
    assert blocks.take_cached("c", chain(root_key("t", "r1", None), [1, 2, 3, 4])) == 0
    assert blocks.drop(new) == 2 and blocks.table("b") and blocks.num_free == 6  # b still holds its blocks
    blocks.free("b"), blocks.free("c")
    assert blocks.num_free == 8 and blocks.num_cached == 0


def _seq(request_id: str, prompt: list[int], root: bytes | None = BASE, **params) -> Sequence:
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, **params)
    return Sequence(request_id=request_id, prompt_token_ids=prompt, params=params, adapter_name=None, adapter=None,
                    max_tokens=2, arrival_time=0.0, cache_root=root)


class _Placer:
    def ensure_device(self, revision, protected):
        raise AssertionError("base-model requests only")

    def take_load_error(self, revision):
        return None

    def release(self, revision) -> None:
        pass

    def slot_view(self, revision):
        return revision


def _step(scheduler: Scheduler):
    batch = scheduler.schedule()
    scheduler.postprocess(batch, [7 if c.is_sampled else None for c in batch.chunks])
    return batch


def test_scheduler_admits_at_the_first_uncached_token_and_counts_blocks_free():
    blocks = BlockManager(BlockManagerConfig(num_blocks=6, block_size=2))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_loras=None, max_waiting=8),
                          blocks, _Placer())
    prompt = [3, 4, 5, 6, 7, 8]
    scheduler.add(_seq("a", prompt))
    first = _step(scheduler)
    assert first.chunks[0].start_pos == 0 and blocks.num_cached == 3
    while scheduler.has_unfinished():
        _step(scheduler)
    scheduler.add(_seq("b", prompt))  # the whole prompt is cached: its last token is computed again
    scheduler.add(_seq("c", prompt[:4] + [9, 9]))
    scheduler.add(_seq("d", prompt, root=root_key(None, None, "salt")))
    batch = scheduler.schedule()
    starts = {c.seq.request_id: (c.start_pos, len(c.token_ids)) for c in batch.chunks}
    assert starts == {"b": (4, 2), "c": (4, 2)}  # d needs 3 blocks; 2 are left (one free, one cached unused)
    assert [s.num_cached_tokens for s in (scheduler.get("b"), scheduler.get("c"))] == [4, 4]
    assert scheduler.prefix_cache_tokens == {"": (3 * 6, 0 + 4 + 4)}


def test_requests_with_prompt_logprobs_do_not_read_the_cache():
    blocks = BlockManager(BlockManagerConfig(num_blocks=16, block_size=2))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_loras=None, max_waiting=8),
                          blocks, _Placer())
    scheduler.add(_seq("a", [3, 4, 5, 6, 7]))
    _step(scheduler)
    scheduler.add(_seq("b", [3, 4, 5, 6, 7], prompt_logprobs=1))
    scheduler.add(_seq("c", [3, 4, 5, 6, 7], root=None))
    assert {c.seq.request_id: c.start_pos for c in _step(scheduler).chunks if c.seq.request_id != "a"} == {
        "b": 0, "c": 0}


def test_a_chunk_caches_only_the_blocks_it_completed():
    """Chunks of 3 tokens in blocks of 2: the first chunk writes block 0 whole and block 1 in part, so only block 0
    is cached, although the prompt's keys are all known."""
    blocks = BlockManager(BlockManagerConfig(num_blocks=16, block_size=2))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=3, max_loras=None, max_waiting=8),
                          blocks, _Placer())
    scheduler.add(_seq("a", [3, 4, 5, 6, 7, 8, 9]))
    _step(scheduler)
    assert blocks.num_cached == 1
    _step(scheduler)
    assert blocks.num_cached == 3
