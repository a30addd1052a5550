"""LLMEngine as the server drives it: typed request errors, steps, aborts, snapshots, adapter lifecycle under
traffic (on-demand loads, failures, in-place reloads, unload after sampled traffic), eviction behaviour."""

from __future__ import annotations

import shutil
import time
import threading

import pytest

from kubelora.engine import EngineConfig, LLMEngine, SamplingParams
from kubelora.engine import errors

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def make_engine(material, **options) -> LLMEngine:
    config = {"max_loras": 4, "max_lora_rank": 32, "max_cpu_loras": 8, **options}
    return LLMEngine(EngineConfig(model_dir=str(material.model_dir), **config))


def drain(engine: LLMEngine, max_steps: int = 2000) -> dict[str, object]:
    """Step until idle; return each request's final output."""
    finals = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return finals
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    raise AssertionError("engine did not finish")


@pytest.fixture(scope="module")
def engine(llama):
    engine = make_engine(llama, max_model_len=64, max_waiting=4)
    for name, path in llama.adapters.items():
        engine.adapters.load(name, path)
    yield engine
    engine.close()


def test_engine_config_validation_names_the_field():
    for field, value in (("max_loras", 0), ("max_lora_rank", -1), ("kv_block_size", 0), ("max_waiting", 0)):
        with pytest.raises(ValueError, match=field):
            EngineConfig(model_dir="m", **{field: value})
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(model_dir="m", dtype="float8")
    with pytest.raises(ValueError, match="device"):
        EngineConfig(model_dir="m", device="tpu")


def test_add_request_raises_typed_errors(engine, prompt_ids):
    with pytest.raises(errors.UnknownAdapter, match="nope"):
        engine.add_request("r1", prompt_ids(0, 4), GREEDY, "nope")
    with pytest.raises(errors.PromptTooLong) as info:
        engine.add_request("r2", prompt_ids(0, 64), GREEDY, None)
    assert info.value.max_model_len == 64 and "63" in str(info.value)
    with pytest.raises(errors.InvalidRequest, match="at least one token"):
        engine.add_request("r3", [], GREEDY, None)
    with pytest.raises(errors.InvalidRequest, match="vocabulary"):
        engine.add_request("r4", [1, 100000], GREEDY, None)
    engine.add_request("dup", prompt_ids(0, 4), GREEDY, None)
    with pytest.raises(errors.InvalidRequest, match="already in flight"):
        engine.add_request("dup", prompt_ids(0, 4), GREEDY, None)
    for i in range(3):
        engine.add_request(f"fill-{i}", prompt_ids(i, 4), GREEDY, "r4-qv")
    with pytest.raises(errors.QueueFull) as full:
        engine.add_request("one-too-many", prompt_ids(0, 4), GREEDY, "r4-qv")
    assert full.value.max_waiting == 4
    assert len(drain(engine)) == 4
    assert engine.adapters.get("r4-qv").num_refs == 0


def test_max_tokens_is_clipped_to_max_model_len(engine, prompt_ids):
    engine.add_request("clip", prompt_ids(1, 60), SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    final = drain(engine)["clip"]
    assert final.finish_reason == "length" and len(final.token_ids) == 4


def test_abort_running_and_waiting_requests(engine, prompt_ids):
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine.add_request("keep", prompt_ids(0, 5), long, "r8-all")
    engine.add_request("drop", prompt_ids(1, 5), long, "r8-all")
    engine.step()
    engine.abort_request("drop")
    engine.abort_request("unknown-id")
    outputs = {o.request_id: o for o in engine.step()}
    assert outputs["drop"].finished and outputs["drop"].finish_reason == "abort"
    assert not outputs["keep"].finished and len(outputs["keep"].token_ids) == 2
    assert drain(engine)["keep"].finish_reason == "length"
    assert engine.adapters.get("r8-all").num_refs == 0


def test_outputs_stream_growing_text_and_times(engine, prompt_ids):
    engine.add_request("s", prompt_ids(2, 6), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                       "r16-all-rs")
    texts, outputs = [], []
    while engine.has_unfinished():
        for output in engine.step():
            outputs.append(output)
            texts.append(output.text)
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert [t for o in outputs for t in o.new_token_ids] == outputs[-1].token_ids
    last = outputs[-1]
    assert last.num_prompt_tokens == 6 and last.first_token_time >= last.arrival_time
    assert last.arrival_time <= last.first_scheduled_time <= last.first_token_time  # queued, then the prefill


def test_snapshot_reports_per_adapter_counts(engine, prompt_ids):
    names = [None, "r4-qv", "r4-qv", "r32-attn"]
    for i, name in enumerate(names):
        engine.add_request(f"snap-{i}", prompt_ids(i, 5), GREEDY, name)
    before = engine.snapshot()
    assert before.num_waiting == {"": 1, "r4-qv": 2, "r32-attn": 1} and before.num_running == {}
    engine.step()
    during = engine.snapshot()
    assert during.num_running == {"": 1, "r4-qv": 2, "r32-attn": 1}
    assert during.last_batch_size == 4 and during.last_batch_adapters == 2 and during.kv_cache_usage > 0
    assert 0 < during.adapter_pool_used_bytes <= during.adapter_pool_total_bytes
    drain(engine)
    after = engine.snapshot()
    assert after.kv_cache_usage == 0 and after.num_running == {} and after.num_adapter_loads >= 4


def test_unload_after_sampled_traffic_drains_and_frees(llama, prompt_ids):
    engine = make_engine(llama)
    baseline = engine.adapters.stats()
    engine.adapters.load("tenant", llama.adapters["r8-all"])
    engine.adapters.load("other", llama.adapters["r4-qv"])
    sampled = SamplingParams(max_tokens=10, temperature=0.9, top_k=50, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"t{i}", prompt_ids(i, 6), sampled, "tenant" if i % 2 else "other")
    engine.step()
    engine.step()
    engine.adapters.unload("tenant")
    with pytest.raises(errors.AdapterUnloading):
        engine.add_request("late", prompt_ids(0, 4), sampled, "tenant")
    finals = drain(engine)
    assert all(o.finish_reason == "length" for o in finals.values()) and len(finals) == 6
    assert engine.adapters.get("tenant") is None
    with pytest.raises(errors.UnknownAdapter):
        engine.add_request("later", prompt_ids(0, 4), sampled, "tenant")
    engine.adapters.unload("other")
    stats = engine.adapters.stats()
    assert (stats.host_bytes, stats.pool_used_bytes) == (baseline.host_bytes, baseline.pool_used_bytes)
    engine.adapters.load("tenant", llama.adapters["r8-all"])  # the name can come back
    engine.add_request("again", prompt_ids(0, 4), GREEDY, "tenant")
    assert drain(engine)["again"].finish_reason == "length"


def test_known_adapter_loads_on_demand_while_others_flow(llama, prompt_ids):
    preloaded = make_engine(llama)
    preloaded.adapters.load("lazy", llama.adapters["r32-attn"])
    preloaded.add_request("x", prompt_ids(3, 7), GREEDY, "lazy")
    expected = drain(preloaded)["x"].token_ids

    engine = make_engine(llama)
    assert engine.adapters.load("lazy", llama.adapters["r32-attn"], preload=False).tier == "known"
    engine.add_request("x", prompt_ids(3, 7), GREEDY, "lazy")
    engine.add_request("base", prompt_ids(4, 7), GREEDY, None)
    finals = drain(engine)
    assert finals["x"].token_ids == expected and finals["base"].finish_reason == "length"
    assert engine.adapters.get("lazy").tier == "device"


def test_failed_on_demand_load_fails_only_its_requests(llama, tmp_path, prompt_ids):
    engine = make_engine(llama)
    path = tmp_path / "vanishing"
    shutil.copytree(llama.adapters["r8-all"], path)
    engine.adapters.load("vanishing", path, preload=False)
    engine.adapters.load("fine", llama.adapters["r4-qv"])
    (path / "adapter_model.safetensors").unlink()
    engine.add_request("doomed-1", prompt_ids(0, 5), GREEDY, "vanishing")
    engine.add_request("ok-1", prompt_ids(1, 5), GREEDY, "fine")
    engine.add_request("doomed-2", prompt_ids(2, 5), GREEDY, "vanishing")
    engine.add_request("ok-2", prompt_ids(3, 5), GREEDY, None)
    finals = drain(engine)
    for rid in ("doomed-1", "doomed-2"):
        assert finals[rid].finish_reason == "error" and "vanishing" in finals[rid].error
    assert finals["ok-1"].finish_reason == finals["ok-2"].finish_reason == "length"
    assert engine.snapshot().num_adapter_load_failures == 1


def test_request_after_an_undelivered_load_failure_does_not_load_again(llama, tmp_path, prompt_ids):
    """A request that arrives after an on-demand load failed, but before the failure reached the waiting
    requests, gets that failure too: no second load, one failure counted."""
    engine = make_engine(llama)
    path = tmp_path / "vanishing"
    shutil.copytree(llama.adapters["r8-all"], path)
    engine.adapters.load("vanishing", path, preload=False)
    (path / "adapter_model.safetensors").unlink()
    engine.add_request("doomed-1", prompt_ids(0, 5), GREEDY, "vanishing")  # starts the load off-thread
    deadline = time.monotonic() + 30
    while engine.snapshot().num_adapter_load_failures == 0:
        assert time.monotonic() < deadline, "the on-demand load did not fail"
        time.sleep(0.01)
    engine.add_request("doomed-2", prompt_ids(1, 5), GREEDY, "vanishing")
    finals = drain(engine)
    for rid in ("doomed-1", "doomed-2"):
        assert finals[rid].finish_reason == "error" and "vanishing" in finals[rid].error
    while engine.adapters.get("vanishing").is_loading:  # a second load would still be running
        assert time.monotonic() < deadline, "an on-demand load did not end"
        time.sleep(0.01)
    assert engine.snapshot().num_adapter_load_failures == 1


def test_in_place_reload_under_traffic(llama, tmp_path, prompt_ids):
    reference = make_engine(llama)
    reference.adapters.load("v1", llama.adapters["r4-qv"])
    reference.adapters.load("v2", llama.adapters["r16-all-rs"])
    long = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    reference.add_request("old", prompt_ids(0, 6), long, "v1")
    reference.add_request("new", prompt_ids(1, 6), long, "v2")
    expected = drain(reference)

    engine = make_engine(llama)
    path = tmp_path / "tenant"
    shutil.copytree(llama.adapters["r4-qv"], path)
    engine.adapters.load("tenant", path)
    engine.add_request("old", prompt_ids(0, 6), long, "tenant")
    engine.step()
    shutil.rmtree(path)
    shutil.copytree(llama.adapters["r16-all-rs"], path)
    engine.adapters.load("tenant", path, load_inplace=True)
    engine.add_request("new", prompt_ids(1, 6), long, "tenant")
    finals = drain(engine)
    assert finals["old"].token_ids == expected["old"].token_ids
    assert finals["new"].token_ids == expected["new"].token_ids
    assert engine.adapters.stats().pool_used_bytes == engine.adapters.get("tenant").bytes


def test_many_adapters_on_few_slots_do_not_thrash(llama, prompt_ids):
    """16 adapters, 4 slots, a pool with room for 4 rank-8 adapters: each adapter is placed about once
    (evictions bounded by the number of adapters), and no batch exceeds max_loras."""
    engine = make_engine(llama, max_loras=4, max_lora_rank=8, max_num_seqs=16)
    for i in range(16):
        engine.adapters.load(f"t{i}", llama.adapters["r8-all"])
    for round_ in range(3):
        for i in range(16):
            engine.add_request(f"t{i}-{round_}", prompt_ids(i, 5), GREEDY, f"t{i}")
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        assert engine.snapshot().last_batch_adapters <= 4
    evictions = engine.snapshot().num_device_evictions
    assert evictions <= 16 - 4 + 2, evictions
    assert steps < 16 * 3 * (GREEDY.max_tokens + 1)


def test_loading_in_another_thread_while_generating(llama, prompt_ids):
    engine = make_engine(llama)
    engine.adapters.load("steady", llama.adapters["r8-all"])
    engine.add_request("ref", prompt_ids(5, 6), GREEDY, "steady")
    expected = drain(engine)["ref"].token_ids
    stop = threading.Event()
    failures = []

    def churn():
        names = list(llama.adapters)
        i = 0
        while not stop.is_set():
            try:
                engine.adapters.load(f"churn-{i % 3}", llama.adapters[names[i % 4]], load_inplace=True)
                engine.adapters.unload(f"churn-{(i + 1) % 3}")
            except Exception as exc:  # noqa: BLE001
                failures.append(exc)
            i += 1

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for i in range(6):
            engine.add_request(f"s{i}", prompt_ids(5, 6), GREEDY, "steady")
        finals = drain(engine)
    finally:
        stop.set()
        thread.join()
    assert not failures
    assert all(o.token_ids == expected for o in finals.values())


def test_wait_for_work(engine, prompt_ids):
    assert not engine.wait_for_work(timeout=0.01)
    engine.add_request("w", prompt_ids(0, 4), GREEDY, None)
    assert engine.wait_for_work(timeout=0.01)
    drain(engine)


def test_idle_engine_prefetches_registered_adapters_on_cuda(llama, monkeypatch):
    """On CUDA the idle engine copies host-tier adapters into free pool rows before requests need them (so a
    first request does not wait for the copy); its traffic then finds them resident. CPU engines leave them."""
    import torch

    engine = make_engine(llama, max_num_batched_tokens=32)
    try:
        for name in ("r4-qv", "r8-all"):
            engine.adapters.load(name, llama.adapters[name])
        engine.capture_pending_graphs(budget_s=float("inf"))
        assert {info.tier for info in engine.adapters.list()} == {"host"}
        monkeypatch.setattr(engine, "device", torch.device("cuda"))  # the engine's CUDA-only idle work, on CPU
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        while engine.capture_pending_graphs(budget_s=0.0):  # one adapter (or warm-up) a call
            pass
        assert {info.tier for info in engine.adapters.list()} == {"device"}
        monkeypatch.undo()
        engine.add_request("a", [1, 2, 3], GREEDY, adapter="r8-all")
        assert drain(engine)["a"].finish_reason == "length"
        assert engine.adapters.stats().num_device_evictions == 0
    finally:
        engine.close()
