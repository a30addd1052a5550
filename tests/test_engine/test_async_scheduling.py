"""Overlapped steps (`async_scheduling`): the next step is launched before this one's tokens are read back.

The same requests give the same outputs with steps overlapped and with each step read back at once: greedy and
seeded tokens, texts, finish reasons and logprobs, across adapters, stop tokens and strings, min_tokens, max_tokens,
requests whose next step needs the host (penalties, a grammar, multi-token bad words), preemptions, adapter time
slices and aborts. Runs on CPU, where the overlap is off by default and switched on here.
"""

from __future__ import annotations

import json

import pytest

from kubelora.engine import LLM, SamplingParams
from kubelora.engine.sequence import PENDING_TOKEN
from kubelora.engine.structured import StructuredKind, StructuredOutput

from .conftest import MAX_RANK, make_prompt

POOL_ROW_BYTES = 8192  # one rank row of every target module of the tiny llama, bfloat16... float32 on CPU
ADAPTER_CYCLE = [None, "r4-qv", "r8-all", "r16-all-rs", "r32-attn"]


def make_llm(llama, is_async: bool, **config) -> LLM:
    settings = dict(max_loras=4, max_lora_rank=MAX_RANK, max_cpu_loras=8) | config
    llm = LLM(llama.model_dir, async_scheduling=is_async, **settings)
    for name, path in llama.adapters.items():
        llm.load_adapter(name, path)
    return llm


def generate(llama, is_async: bool, prompts, params, adapters, **config):
    llm = make_llm(llama, is_async, **config)
    try:
        results = llm.generate(prompts, params, adapters)
        return results, (llm.engine.snapshot().num_preemptions, llm.engine._scheduler.num_pauses)
    finally:
        llm.close()


def summary(results) -> list[tuple]:
    return [(r.token_ids, r.text, r.finish_reason, r.error, r.logprobs) for r in results]


def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **extra)


def test_overlapped_steps_give_the_same_outputs(llama):
    prompts = [make_prompt(i, 4 + 3 * (i % 4)) for i in range(10)]
    adapters = [ADAPTER_CYCLE[i % len(ADAPTER_CYCLE)] for i in range(10)]
    plain = [greedy(12)] * 10
    reference, _ = generate(llama, False, prompts, plain, adapters)
    tokens = [r.token_ids for r in reference]
    params = [
        greedy(3),
        greedy(11),
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(tokens[2][4],)),  # stops at step 5 or before
        SamplingParams(max_tokens=12, temperature=0.0, stop=(reference[3].text[4:7],)),  # a stop string
        SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=7),
        greedy(9, logprobs=3),
        SamplingParams(max_tokens=8, temperature=0.0, min_tokens=6, stop_token_ids=(tokens[6][1],)),
        greedy(9, repetition_penalty=1.3, frequency_penalty=0.5),  # the next step needs this one's tokens
        greedy(9, bad_words_token_ids=((tokens[8][0], tokens[8][1]),)),  # a two-token word: needs the host too
        SamplingParams(max_tokens=12, temperature=0.0,
                       structured=StructuredOutput(StructuredKind.CHOICE, json.dumps(["yes", "no", "maybe so"]))),
    ]
    sync, _ = generate(llama, False, prompts, params, adapters)
    overlapped, _ = generate(llama, True, prompts, params, adapters)
    assert summary(overlapped) == summary(sync)
    assert sync[2].finish_reason == "stop" and len(sync[2].token_ids) <= 5
    assert sync[3].finish_reason == "stop" and sync[0].finish_reason == "length"
    assert all(PENDING_TOKEN not in r.token_ids for r in overlapped)


def test_overlapped_steps_survive_preemption_and_time_slices(llama):
    """A KV cache too small for the batch (preemptions) and a device adapter pool with room for two of four
    adapters (time slices): the overlapped engine gives the sync engine's tokens."""
    prompts = [make_prompt(i, 6 + i % 5) for i in range(12)]
    adapters = [ADAPTER_CYCLE[1 + i % 4] for i in range(12)]
    params = [greedy(14 + i % 3) for i in range(12)]
    rows = 24  # in rank rows of every module (the pool is paged per module): r32-attn beside r8-all, not r16-all-rs
    limits = dict(max_loras=None, max_lora_pool_bytes=rows * POOL_ROW_BYTES, num_kv_blocks=14, kv_block_size=4,
                  max_model_len=40, lora_time_slice_steps=3)
    sync, (sync_preemptions, sync_pauses) = generate(llama, False, prompts, params, adapters, **limits)
    overlapped, (preemptions, pauses) = generate(llama, True, prompts, params, adapters, **limits)
    assert summary(overlapped) == summary(sync)
    assert preemptions > 0 and sync_preemptions > 0 and pauses > 0 and sync_pauses > 0


def test_abort_while_a_step_is_in_flight(llama):
    llm = make_llm(llama, True)
    engine = llm.engine
    try:
        engine.add_request("keep", make_prompt(0, 5), greedy(10), "r8-all")
        engine.add_request("drop", make_prompt(1, 5), greedy(10), "r4-qv")
        seen = [o for _ in range(3) for o in engine.step()]
        assert engine.has_unfinished()
        engine.abort_request("drop")
        while engine.has_unfinished():
            seen += engine.step()
        finals = {o.request_id: o for o in seen if o.finished}
        assert finals["drop"].finish_reason == "abort" and PENDING_TOKEN not in finals["drop"].token_ids
        assert finals["keep"].finish_reason == "length" and len(finals["keep"].token_ids) == 10
        assert [o for o in seen if o.request_id == "drop" and o.finished] == [finals["drop"]]
        assert engine.adapters.get("r8-all").num_refs == 0 and engine.adapters.get("r4-qv").num_refs == 0
    finally:
        llm.close()
    reference, _ = generate(llama, False, [make_prompt(0, 5)], [greedy(10)], ["r8-all"])
    assert finals["keep"].token_ids == reference[0].token_ids


@pytest.mark.parametrize("extra", [{}, {"presence_penalty": 0.5},
                                   {"structured": StructuredOutput(StructuredKind.REGEX, "[a-z ]{40}")}])
def test_steps_overlap_for_every_request(llama, extra):
    """The forward pass of step N+1 is queued before step N is read back (its pending tokens come from the
    device), whatever the requests' sampling needs; their sampling stage is queued after."""
    llm = make_llm(llama, True)
    events = []
    runner = llm.engine._runner
    forward, sample, postprocess = runner.forward, runner.sample, llm.engine._postprocess

    def spy_forward(batch, previous=None):
        events.append("forward" + ("+pending" if any(c.token_ids[-1] == PENDING_TOKEN for c in batch.chunks)
                                   else ""))
        return forward(batch, previous)

    def spy_sample(step):
        events.append("sample")
        return sample(step)

    def spy_postprocess(step):
        events.append("read")
        return postprocess(step)

    runner.forward, runner.sample, llm.engine._postprocess = spy_forward, spy_sample, spy_postprocess
    try:
        results = llm.generate([make_prompt(i, 5) for i in range(3)], greedy(6, **extra), [None, "r4-qv", None])
    finally:
        llm.close()
    assert all(len(r.token_ids) == 6 for r in results)
    text = " ".join(events)
    assert "forward+pending read sample" in text  # N+1's forward, then N read back, then N+1's sampling


@pytest.mark.parametrize("num_pending", [1, 2])
def test_min_tokens_counts_the_tokens_before_the_sampled_one(num_pending):
    """A scheduled sequence's own token is pending when its sampling inputs are built; a token of the step in
    flight (two pending) counts as generated before it."""
    import torch

    from kubelora.engine.sampling_batch import prepare_sampling
    from kubelora.engine.sequence import Sequence

    params = SamplingParams(min_tokens=5, stop_token_ids=(9,), temperature=0.0)

    def banned(num_known: int) -> bool:
        seq = Sequence(request_id="s", prompt_token_ids=[1, 2], params=params, adapter_name=None, adapter=None,
                       max_tokens=16, arrival_time=0.0, output_token_ids=[3] * num_known, num_pending=num_pending)
        batch = prepare_sampling([seq], 32, torch.device("cpu"))
        return batch.banned is not None and 9 in batch.banned.tokens.tolist()

    before = 4 - (num_pending - 1)  # known tokens that, with the in-flight one, make 4 before the sampled one
    assert banned(before) and not banned(before + 1)
