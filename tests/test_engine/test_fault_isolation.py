"""One request's fault never stops the engine: it fails that request alone and every other one finishes with the
tokens it gets when run alone. Covers sampling parameters that broke the sampler (two allowed_token_ids rows in a
batch, a temperature or penalty whose float32 value is degenerate), a request whose logits row is not finite, and
an exception raised by a step (forward or sampling stage, with steps overlapped or not). Runs on CPU."""

from __future__ import annotations

import pytest
import torch

from kubelora.engine import EngineConfig, LLMEngine, SamplingParams
from kubelora.engine.errors import InvalidRequest
from kubelora.contract.errors import FailureKind
from kubelora.engine.sampling_batch import token_bitmask
from kubelora.engine.structured.matcher import unpack_bitmask

from .conftest import MAX_RANK, make_prompt

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
ADAPTERS = [None, "r4-qv", "r8-all", None, "r32-attn"]
BAD = "bad"


def make_engine(llama, is_async: bool = False) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model_dir=str(llama.model_dir), max_loras=4, max_lora_rank=MAX_RANK,
                                    max_cpu_loras=8, async_scheduling=is_async))
    for name, path in llama.adapters.items():
        engine.adapters.load(name, path)
    return engine


@pytest.fixture(scope="module")
def engines(llama):
    built = {is_async: make_engine(llama, is_async) for is_async in (False, True)}
    yield built
    for engine in built.values():
        engine.close()


def drain(engine: LLMEngine, max_steps: int = 500) -> dict:
    finals = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return finals
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    raise AssertionError("the engine did not finish")


def run(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams, str | None]]) -> dict:
    for request_id, prompt, params, adapter in requests:
        engine.add_request(request_id, prompt, params, adapter)
    return drain(engine)


def busy_batch(params: SamplingParams = GREEDY) -> list[tuple]:
    """Five requests over three adapters and the base model, one of them (BAD) the faulty one."""
    requests = [(f"ok{i}", make_prompt(i, 4 + i), params, adapter) for i, adapter in enumerate(ADAPTERS)]
    requests[2] = (BAD, *requests[2][1:])
    return requests


def alone(engine: LLMEngine, requests: list[tuple]) -> dict[str, list[int]]:
    """Each request's tokens when it runs alone."""
    return {r[0]: run(engine, [r])[r[0]].token_ids for r in requests}


def assert_engine_clean(engine: LLMEngine) -> None:
    """Every finished request gave back its KV blocks and adapter references."""
    assert not engine.has_unfinished()
    assert engine.snapshot().kv_cache_usage == 0.0
    assert all(info.num_refs == 0 for info in engine.adapters.list())


# ---- sampling parameters ----

@pytest.mark.parametrize("is_async", [False, True])
def test_two_allowed_token_ids_rows_in_one_batch(engines, is_async):
    engine = engines[is_async]
    allowed = (300, 301, 302)
    sampled = [SamplingParams(max_tokens=5, temperature=1.0, seed=i, allowed_token_ids=allowed, ignore_eos=True)
               for i in range(2)]
    requests = [(f"n{i}", make_prompt(1, 6), p, ADAPTERS[i]) for i, p in enumerate(sampled)]
    requests.append(("greedy", make_prompt(2, 5), SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True,
                                                                 allowed_token_ids=(400, 7)), None))
    requests.append(("free", make_prompt(3, 5), GREEDY, "r8-all"))
    finals = run(engine, requests)
    assert all(finals[r[0]].finish_reason == "length" for r in requests), finals
    assert all(set(finals[f"n{i}"].token_ids) <= set(allowed) for i in range(2))
    assert set(finals["greedy"].token_ids) <= {400, 7}
    assert {rid: o.token_ids for rid, o in finals.items()} == alone(engine, requests)  # seeded rows draw alone


def test_allowed_token_ids_are_deduplicated_into_one_bitmask():
    params = SamplingParams(allowed_token_ids=[5, 70, 5, 31, 70])
    assert params.allowed_token_ids == (5, 70, 31)
    assert SamplingParams(stop_token_ids=[9, 9, 3]).stop_token_ids == (9, 3)
    mask = unpack_bitmask(token_bitmask(params.allowed_token_ids, 100)[None], 100)[0]
    assert mask.nonzero().flatten().tolist() == [5, 31, 70]
    top = unpack_bitmask(token_bitmask((31, 63, 0), 64)[None], 64)[0]  # bit 31 is int32's sign bit
    assert top.nonzero().flatten().tolist() == [0, 31, 63]


def test_allowed_token_ids_outside_the_vocabulary_are_refused(engines):
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        engines[False].add_request("big", make_prompt(0, 4), SamplingParams(allowed_token_ids=(1, 10**6)))


@pytest.mark.parametrize("is_async", [False, True])
def test_tiny_temperature_is_greedy(engines, is_async):
    engine = engines[is_async]
    prompt = make_prompt(4, 7)
    tiny = SamplingParams(max_tokens=6, temperature=1e-40, ignore_eos=True)
    assert tiny.is_greedy and not SamplingParams(temperature=1e-5).is_greedy
    finals = run(engine, [("tiny", prompt, tiny, "r8-all"), ("zero", prompt, GREEDY, "r8-all")])
    assert finals["tiny"].finish_reason == "length"
    assert finals["tiny"].token_ids == finals["zero"].token_ids


@pytest.mark.parametrize("field, value", [
    ("repetition_penalty", 1e-40), ("repetition_penalty", 0.0), ("repetition_penalty", float("nan")),
    ("temperature", float("inf")), ("temperature", float("nan")), ("top_p", float("nan")),
    ("min_p", float("inf")), ("presence_penalty", float("-inf")), ("frequency_penalty", float("nan")),
])
def test_degenerate_floats_are_refused_naming_the_field(field, value):
    with pytest.raises(InvalidRequest, match=field) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field and "must be in" in info.value.message


@pytest.mark.parametrize("bias", [float("nan"), float("inf"), 1e40])
def test_degenerate_logit_bias_is_refused(bias):
    with pytest.raises(InvalidRequest, match="logit_bias") as info:
        SamplingParams(logit_bias={3: bias})
    assert info.value.param == "logit_bias"


# ---- a request whose logits are not finite ----

def poison_rows(engine: LLMEngine, monkeypatch, value: float) -> None:
    """The forward pass gives BAD's sampled logits row `value` at one token (as an adapter with NaN weights)."""
    runner = engine._runner
    forward = runner.forward

    def poisoned(batch, previous=None):
        step = forward(batch, previous)
        for i, chunk in enumerate(batch.chunks):
            row = i if step.plan is None else step.plan.sample_rows[i]
            if chunk.seq.request_id == BAD and row is not None:
                with torch.inference_mode():  # the forward's logits are inference tensors
                    step.logits[row, 11] = value
        return step

    monkeypatch.setattr(runner, "forward", poisoned)


@pytest.mark.parametrize("is_async", [False, True])
@pytest.mark.parametrize("value, params", [
    (float("nan"), GREEDY),
    (float("inf"), GREEDY),
    (float("nan"), SamplingParams(max_tokens=6, temperature=0.8, seed=5, ignore_eos=True)),
    (float("nan"), SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)),
])
def test_non_finite_logits_fail_only_their_request(engines, monkeypatch, is_async, value, params):
    engine = engines[is_async]
    requests = busy_batch(params)
    expected = alone(engine, requests)
    poison_rows(engine, monkeypatch, value)
    finals = run(engine, requests)
    assert finals[BAD].finish_reason == "error" and "not finite" in finals[BAD].error
    assert finals[BAD].error_kind is FailureKind.NON_FINITE_LOGITS
    assert finals[BAD].token_ids == []
    others = {rid: o.token_ids for rid, o in finals.items() if rid != BAD}
    assert others == {rid: t for rid, t in expected.items() if rid != BAD}
    assert all(finals[rid].finish_reason == "length" for rid in others)
    assert_engine_clean(engine)


def test_filters_that_leave_no_token_fail_only_their_request(engines):
    """allowed_token_ids holding only EOS while min_tokens bans it: no token is left for that request."""
    engine = engines[False]
    eos = engine.eos_token_ids[0]
    empty = SamplingParams(max_tokens=4, temperature=0.7, min_tokens=2, allowed_token_ids=(eos,))
    requests = [("empty", make_prompt(5, 5), empty, None), ("ok", make_prompt(6, 5), GREEDY, "r4-qv")]
    finals = run(engine, requests)
    assert finals["empty"].finish_reason == "error" and "no token is left" in finals["empty"].error
    assert finals["empty"].error_kind is FailureKind.NO_TOKEN_LEFT and finals["ok"].error_kind is None
    assert finals["ok"].token_ids == alone(engine, requests[1:])["ok"]
    assert_engine_clean(engine)


# ---- a step that raises ----

def break_stage(engine: LLMEngine, monkeypatch, stage: str, calls: list) -> None:
    """The runner's `stage` ("forward" or "sample") raises whenever BAD is in its batch."""
    runner = engine._runner
    original = getattr(runner, stage)

    def broken(step_or_batch, *args):
        batch = step_or_batch if stage == "forward" else step_or_batch.batch
        ids = [c.seq.request_id for c in batch.chunks]
        calls.append(ids)
        if BAD in ids:
            raise IndexError("a bug that one request's state triggers")
        return original(step_or_batch, *args)

    monkeypatch.setattr(runner, stage, broken)


@pytest.mark.parametrize("is_async", [False, True])
@pytest.mark.parametrize("stage", ["forward", "sample"])
def test_a_step_exception_fails_only_the_request_that_fails_alone(engines, monkeypatch, is_async, stage):
    engine = engines[is_async]
    requests = busy_batch()
    expected = alone(engine, requests)
    calls: list[list[str]] = []
    break_stage(engine, monkeypatch, stage, calls)
    finals = run(engine, requests)
    assert finals[BAD].finish_reason == "error" and "IndexError" in finals[BAD].error
    assert finals[BAD].error_kind is FailureKind.ENGINE_FAULT
    assert "one request's state" not in finals[BAD].error  # the exception's text stays in the log
    others = {rid: o.token_ids for rid, o in finals.items() if rid != BAD}
    assert others == {rid: t for rid, t in expected.items() if rid != BAD}
    assert [BAD] in calls and len([c for c in calls if len(c) > 1 and BAD in c]) == 1  # retried alone once
    assert_engine_clean(engine)
    monkeypatch.undo()
    after = run(engine, [("after", make_prompt(9, 5), GREEDY, "r8-all")])  # the engine goes on
    assert after["after"].finish_reason == "length"


def test_a_request_in_repeated_failed_batches_fails(engines, monkeypatch):
    """A fault that needs two requests together never shows alone: both pass their retry, then fail the next
    time they share a batch."""
    engine = engines[False]
    pair = {"p0", "p1"}
    forward = engine._runner.forward

    def broken(batch, previous=None):
        if pair <= {c.seq.request_id for c in batch.chunks}:
            raise ValueError("two rows together")
        return forward(batch, previous)

    monkeypatch.setattr(engine._runner, "forward", broken)
    finals = run(engine, [("p0", make_prompt(0, 5), GREEDY, None), ("p1", make_prompt(1, 5), GREEDY, "r4-qv")])
    assert {finals[r].finish_reason for r in pair} == {"error"}
    assert {finals[r].error_kind for r in pair} == {FailureKind.ENGINE_FAULT}
    assert all(len(finals[r].token_ids) == 1 for r in pair)  # the one token each drew alone
    assert_engine_clean(engine)


def test_a_device_fault_stops_the_engine(llama, monkeypatch):
    engine = make_engine(llama)
    try:
        def lost(batch, previous=None):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        monkeypatch.setattr(engine._runner, "forward", lost)
        engine.add_request("r", make_prompt(0, 4), GREEDY)
        with pytest.raises(RuntimeError, match="CUDA error"):
            engine.step()
    finally:
        engine.close()


def test_sampler_reports_non_finite_rows_in_the_ids(sampling_batch):
    from kubelora.engine.sampler import FAULT_NON_FINITE_LOGITS, sample, sample_on_device

    logits = torch.randn(3, 16)
    logits[1, 4] = float("nan")
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.9)):
        batch = sampling_batch(logits, [params] * 3)
        ids = sample(logits, batch).token_ids
        assert ids[1] == FAULT_NON_FINITE_LOGITS and ids[0] >= 0 and ids[2] >= 0
        device_ids = sample_on_device(logits, batch).tokens  # what the next step reads: always a token
        assert 0 <= int(device_ids[1]) < 16
