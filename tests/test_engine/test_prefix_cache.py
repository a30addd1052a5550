"""Prefix caching on a real tiny model: greedy tokens and logprobs with the cache equal the cache off and
transformers+PEFT, and hits happen exactly where the key (tokens, adapter name and content revision, cache_salt)
allows them. Each test fails if the key leaves one of its parts out: the hit counts and the outputs would show it.
"""

from __future__ import annotations

import pytest
import torch

from kubelora.engine import LLM, SamplingParams

BLOCK = 4
PROMPT_LEN = 23  # 5 full blocks and 3 tokens: a hit takes 20 tokens
NUM_HIT = 20
TOL = 1e-4  # float32 logprob difference
ADAPTERS = ("r4-qv", "r8-all", "r16-all-rs", "r32-attn")


@pytest.fixture(scope="module")
def greedy():
    return SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def reference(llama, peft_reference):
    build, _ = peft_reference
    return build(llama)


def make_llm(llama, adapters=ADAPTERS, **options) -> LLM:
    llm = LLM(llama.model_dir, **{"max_loras": 4, "max_lora_rank": 32, "max_cpu_loras": 8, "kv_block_size": BLOCK,
                                  **options})
    for name in adapters:
        llm.load_adapter(name, llama.adapters[name])
    return llm


def generate_each(llm: LLM, requests, params: SamplingParams) -> list:
    """(prompt, adapter, salt) one after another: each request finishes before the next is admitted."""
    return [llm.generate([p], params, adapters=[a], cache_salts=[s])[0] for p, a, s in requests]


def assert_same(results, expected) -> None:
    for got, want in zip(results, expected, strict=True):
        assert got.token_ids == want.token_ids
        lp_got = torch.tensor([e.chosen.logprob for e in got.logprobs])
        lp_want = torch.tensor([e.chosen.logprob for e in want.logprobs])
        assert (lp_got - lp_want).abs().max() < TOL


def assert_matches_peft(reference, peft_reference, results, requests) -> None:
    """Each result's greedy tokens and logprobs are transformers+PEFT's with the adapter the request named."""
    _, reference_logits = peft_reference
    for result, (prompt, adapter, _) in zip(results, requests, strict=True):
        logits = reference_logits(reference, adapter, prompt + result.token_ids[:-1])[len(prompt) - 1:]
        logprobs = torch.log_softmax(logits.float(), -1)
        assert logits.argmax(-1).tolist() == result.token_ids, adapter
        chosen = logprobs[torch.arange(len(result.token_ids)), torch.tensor(result.token_ids)]
        got = torch.tensor([e.chosen.logprob for e in result.logprobs])
        assert (chosen - got).abs().max() < TOL, adapter


def hits(results) -> list[int]:
    return [r.num_cached_tokens for r in results]


@pytest.mark.parametrize("is_async", [False, True])  # async: blocks are cached only once their step is read back
def test_adapters_and_base_sharing_a_prompt_hit_only_their_own_blocks(llama, greedy, prompt_ids, reference,
                                                                      peft_reference, is_async):
    prompt = prompt_ids(1, PROMPT_LEN)
    names = [None, *ADAPTERS]
    requests = [(prompt, name, None) for name in names] * 2
    llm = make_llm(llama, async_scheduling=is_async)
    off = make_llm(llama, enable_prefix_caching=False)
    try:
        results = generate_each(llm, requests, greedy)
        assert hits(results) == [0] * len(names) + [NUM_HIT] * len(names)
        assert_same(results, generate_each(off, requests, greedy))
        snapshot = llm.engine.snapshot().prefix_cache_tokens
        assert snapshot == {key: (2 * PROMPT_LEN, NUM_HIT) for key in ["", *ADAPTERS]}
    finally:
        llm.close(), off.close()
    assert_matches_peft(reference, peft_reference, results, requests)


def test_a_longer_prompt_hits_its_shared_prefix_and_a_batch_shares_blocks(llama, greedy, prompt_ids):
    """A request whose prompt extends a cached one takes the shared full blocks; requests admitted together share
    what an earlier request cached."""
    prompt = prompt_ids(2, PROMPT_LEN)
    longer = prompt + prompt_ids(3, 9)
    requests = [(prompt, "r8-all", None), (longer, "r8-all", None)]
    llm, off = make_llm(llama), make_llm(llama, enable_prefix_caching=False)
    try:
        results = generate_each(llm, requests, greedy)
        assert hits(results) == [0, NUM_HIT]
        assert_same(results, generate_each(off, requests, greedy))
        batch = llm.generate([longer, prompt, longer], greedy, adapters="r8-all")
        assert hits(batch) == [28, NUM_HIT, 28]  # the longer prompt's blocks were cached by the request above
        assert_same(batch, [results[1], results[0], results[1]])
    finally:
        llm.close(), off.close()


def test_a_next_turn_finds_the_blocks_its_answer_filled(llama, greedy, prompt_ids, reference, peft_reference):
    """A chat's next turn carries the previous answer: the blocks decode steps filled are cached too (the first
    turn computed 23 prompt + 5 fed generated tokens: 7 full blocks)."""
    prompt = prompt_ids(9, PROMPT_LEN)
    llm, off = make_llm(llama), make_llm(llama, enable_prefix_caching=False)
    try:
        first = generate_each(llm, [(prompt, "r32-attn", None)], greedy)[0]
        turn = prompt + first.token_ids + prompt_ids(19, 5)
        second = generate_each(llm, [(turn, "r32-attn", None)], greedy)
        assert hits(second) == [28]
        assert_same(second, generate_each(off, [(turn, "r32-attn", None)], greedy))
    finally:
        llm.close(), off.close()
    assert_matches_peft(reference, peft_reference, second, [(turn, "r32-attn", None)])


def test_in_place_revision_of_the_same_name_reuses_nothing(llama, greedy, prompt_ids, reference, peft_reference,
                                                           monkeypatch):
    """The revision in the key alone keeps the old revision's blocks away: the eager drop at unload is turned off
    here, so a key without the revision would hit (and compute with the old adapter's K/V)."""
    prompt = prompt_ids(4, PROMPT_LEN)
    llm = make_llm(llama)
    monkeypatch.setattr(llm.engine.adapters, "take_retired", lambda: [])
    try:
        llm.load_adapter("tenant", llama.adapters["r8-all"])
        first = generate_each(llm, [(prompt, "tenant", None)] * 2, greedy)
        llm.load_adapter("tenant", llama.adapters["r16-all-rs"], load_inplace=True)
        second = generate_each(llm, [(prompt, "tenant", None)] * 2, greedy)
    finally:
        llm.close()
    assert hits(first) == [0, NUM_HIT] and hits(second) == [0, NUM_HIT]
    assert_matches_peft(reference, peft_reference, first + second,
                        [(prompt, "r8-all", None)] * 2 + [(prompt, "r16-all-rs", None)] * 2)


def test_unload_then_load_of_the_same_name_from_other_files_reuses_nothing(llama, greedy, prompt_ids, reference,
                                                                          peft_reference, monkeypatch):
    prompt = prompt_ids(5, PROMPT_LEN)
    llm = make_llm(llama)
    monkeypatch.setattr(llm.engine.adapters, "take_retired", lambda: [])  # the key alone, as above
    try:
        llm.load_adapter("tenant", llama.adapters["r4-qv"])
        first = generate_each(llm, [(prompt, "tenant", None)], greedy)
        assert llm.unload_adapter("tenant")
        llm.load_adapter("tenant", llama.adapters["r32-attn"])
        second = generate_each(llm, [(prompt, "tenant", None)] * 2, greedy)
    finally:
        llm.close()
    assert hits(first) == [0] and hits(second) == [0, NUM_HIT]
    assert_matches_peft(reference, peft_reference, first + second,
                        [(prompt, "r4-qv", None)] + [(prompt, "r32-attn", None)] * 2)


def test_unload_and_in_place_reload_drop_the_old_revisions_blocks(llama, greedy, prompt_ids):
    prompt = prompt_ids(6, PROMPT_LEN)
    llm = make_llm(llama)
    blocks = llm.engine._blocks
    try:
        llm.load_adapter("tenant", llama.adapters["r4-qv"])
        base = generate_each(llm, [(prompt, None, None)], greedy)
        num_base = blocks.num_cached
        generate_each(llm, [(prompt, "tenant", None)], greedy)
        assert blocks.num_cached > num_base
        llm.load_adapter("tenant", llama.adapters["r8-all"], load_inplace=True)
        generate_each(llm, [(prompt, None, None)], greedy)  # a step drops the replaced revision's blocks
        assert blocks.num_cached == num_base
        generate_each(llm, [(prompt, "tenant", None)], greedy)
        assert blocks.num_cached > num_base
        assert llm.unload_adapter("tenant")
        again = generate_each(llm, [(prompt, None, None)], greedy)
        assert blocks.num_cached == num_base and hits(again) == [NUM_HIT]
        assert_same(again, base)
    finally:
        llm.close()


def test_cache_salts_share_only_within_a_salt(llama, greedy, prompt_ids, reference, peft_reference):
    prompt = prompt_ids(7, PROMPT_LEN)
    requests = [(prompt, "r8-all", salt) for salt in ("tenant-a", "tenant-b", None, "tenant-a", "tenant-b", None)]
    llm = make_llm(llama)
    try:
        results = generate_each(llm, requests, greedy)
    finally:
        llm.close()
    assert hits(results) == [0, 0, 0, NUM_HIT, NUM_HIT, NUM_HIT]
    assert_matches_peft(reference, peft_reference, results, requests)


def test_a_cache_salt_equal_to_an_adapter_name_does_not_alias(llama, greedy, prompt_ids, reference, peft_reference):
    """The adapter's blocks and a base request salted with the adapter's name (or its revision) stay apart: each
    key part carries its kind."""
    prompt = prompt_ids(8, PROMPT_LEN)
    llm = make_llm(llama)
    revision = next(a.revision for a in llm.list_adapters() if a.name == "r8-all")
    requests = [(prompt, "r8-all", None), (prompt, None, "r8-all"), (prompt, None, revision),
                (prompt, "r8-all", None)]
    try:
        results = generate_each(llm, requests, greedy)
    finally:
        llm.close()
    assert hits(results) == [0, 0, 0, NUM_HIT]
    assert_matches_peft(reference, peft_reference, results, requests)


def test_eviction_pressure(llama, greedy, prompt_ids, reference, peft_reference):
    """16 blocks of 4 tokens: each request takes 8 (23 prompt + 6 generated tokens), so the third distinct prompt
    evicts the first one's blocks, least recently used first."""
    prompts = [prompt_ids(10 + i, PROMPT_LEN) for i in range(3)]
    order = [0, 0, 1, 2, 0, 1, 1]
    requests = [(prompts[i], "r4-qv", None) for i in order]
    llm, off = make_llm(llama, num_kv_blocks=16, max_model_len=64), make_llm(llama, num_kv_blocks=16, max_model_len=64,
                                                                    enable_prefix_caching=False)
    try:
        results = generate_each(llm, requests, greedy)
        assert_same(results, generate_each(off, requests, greedy))
        batch = llm.generate([p for p, _, _ in requests], greedy, adapters="r4-qv")  # preempts under pressure
        assert_same(batch, results)
    finally:
        llm.close(), off.close()
    # 0 hits itself; 1 and 2 evict its blocks (its last blocks first); the second 1 finds its own.
    assert hits(results)[:4] == [0, NUM_HIT, 0, 0] and hits(results)[4] < NUM_HIT and hits(results)[6] == NUM_HIT
    assert_matches_peft(reference, peft_reference, results, requests)


@pytest.mark.parametrize("is_async", [False, True])  # async: a request preempted while its step is in flight
def test_preempted_requests_resume_from_their_cached_blocks(llama, prompt_ids, reference, peft_reference,
                                                           monkeypatch, is_async):
    """Too few blocks for the batch: requests are preempted, and at re-admission take the blocks they had
    cached (those not evicted meanwhile), so their prefill starts at the first uncached token. One adapter, so a
    preempted request is the first one back (another key's request could take its blocks first)."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    prompts = [prompt_ids(20 + i, PROMPT_LEN) for i in range(4)]
    names = ["r8-all"] * 4
    llm = make_llm(llama, num_kv_blocks=20, max_model_len=64, async_scheduling=is_async)
    off = make_llm(llama, num_kv_blocks=20, max_model_len=64, enable_prefix_caching=False)
    resumed = []
    take = llm.engine._blocks.take_cached

    def spy(seq_id, keys):
        num = take(seq_id, keys)
        seq = llm.engine._scheduler.get(seq_id)
        if seq.num_preemptions:
            resumed.append(num)
        return num

    monkeypatch.setattr(llm.engine._blocks, "take_cached", spy)
    try:
        results = llm.generate(prompts, params, adapters=names)
        assert llm.engine._scheduler.num_preemptions > 0 and max(resumed) > 0
        assert_same(results, off.generate(prompts, params, adapters=names))
    finally:
        llm.close(), off.close()
    assert_matches_peft(reference, peft_reference, results, [(p, n, None) for p, n in zip(prompts, names)])


def test_chunked_prefill_through_a_cached_prefix(llama, greedy, prompt_ids, reference, peft_reference):
    """Chunks of 6 tokens: the second request's first chunk starts after its 28 cached tokens."""
    prompt = prompt_ids(30, 31) + prompt_ids(31, 10)
    requests = [(prompt[:31], "r16-all-rs", None), (prompt, "r16-all-rs", None), (prompt, None, None)]
    llm = make_llm(llama, max_num_batched_tokens=6)
    off = make_llm(llama, max_num_batched_tokens=6, enable_prefix_caching=False)
    try:
        results = generate_each(llm, requests, greedy)
        assert_same(results, generate_each(off, requests, greedy))
    finally:
        llm.close(), off.close()
    assert hits(results) == [0, 28, 0]
    assert_matches_peft(reference, peft_reference, results, requests)


def test_static_prefill_chunks_after_a_cached_prefix(llama, greedy, prompt_ids, cpu_graphs, reference,
                                                     peft_reference, monkeypatch):
    """A lone sequence's prefill chunk after its cached prefix replays a (stand-in) graph: positions and block
    tables start mid-sequence, as the graph's static inputs allow."""
    from kubelora.engine.step.executor import StepExecutor
    from kubelora.engine.step.shape import Phase

    prompt = prompt_ids(40, PROMPT_LEN)
    requests = [(prompt, "r4-qv", None), (prompt, "r4-qv", None), (prompt, None, None), (prompt, None, None)]
    starts = []
    run = StepExecutor.run

    def spy(self, step, pending=None, is_eager=False):
        shape = None if is_eager else self.shape(step)
        if shape is not None and shape.phase is Phase.PREFILL:
            starts.append(step.start_pos[0])
        return run(self, step, pending, is_eager)

    monkeypatch.setattr(StepExecutor, "run", spy)
    llm = make_llm(llama, adapters=["r4-qv"], max_num_seqs=8)  # one adapter shape: its graphs are captured
    try:
        results = generate_each(llm, requests, greedy)
    finally:
        llm.close()
    assert hits(results) == [0, NUM_HIT, 0, NUM_HIT]
    assert starts.count(NUM_HIT) == 2 and starts.count(0) == 2
    assert_matches_peft(reference, peft_reference, results, requests)


def test_requests_needing_prompt_logprobs_compute_their_whole_prompt(llama, prompt_ids):
    prompt = prompt_ids(50, PROMPT_LEN)
    llm = make_llm(llama)
    try:
        plain = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        first = llm.generate([prompt], plain)[0]
        with_logprobs = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1))[0]
        again = llm.generate([prompt], plain)[0]
    finally:
        llm.close()
    assert (first.num_cached_tokens, with_logprobs.num_cached_tokens, again.num_cached_tokens) == (0, 0, NUM_HIT)
    assert len(with_logprobs.prompt_logprobs) == PROMPT_LEN - 1


@pytest.mark.gpu
def test_cuda_graphs_and_overlapped_steps_on_a_cached_prefix(llama, prompt_ids, peft_reference):
    """On CUDA (graphs, overlapped steps, the Triton LoRA kernels): requests after a cached prefix, alone (a graph-
    replayed prefill chunk) and in a batch (graph-replayed decode over shared blocks), give the cache-off tokens."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    shared = prompt_ids(60, 33)
    prompts = [shared + prompt_ids(61 + i, 2 + 3 * i) for i in range(6)]
    names = [None, "r4-qv", "r8-all", None, "r16-all-rs", "r32-attn"]
    requests = [(p, n, None) for p, n in zip(prompts, names)]
    runs = {}
    for is_cached in (True, False):
        llm = make_llm(llama, device="cuda", dtype="float32", max_num_seqs=16, kv_block_size=16,
                       enable_prefix_caching=is_cached)
        try:
            alone = generate_each(llm, requests, params)
            batch = llm.generate(prompts * 2, params, adapters=names * 2)
            runs[is_cached] = (alone, batch)
        finally:
            llm.close()
    (alone, batch), (alone_off, batch_off) = runs[True], runs[False]
    assert hits(alone) == [0, 0, 0, 32, 0, 0] and all(h >= 32 for h in hits(batch))
    assert [r.token_ids for r in alone + batch] == [r.token_ids for r in alone_off + batch_off]
    build_reference, reference_logits = peft_reference
    reference = build_reference(llama, device="cuda")
    for (prompt, name, _), result in zip(requests * 3, alone + batch):
        logits = reference_logits(reference, name, prompt + result.token_ids[:-1])
        assert logits[len(prompt) - 1:].argmax(-1).tolist() == result.token_ids, name
