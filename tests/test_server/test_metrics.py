"""/metrics after a known workload: per-adapter counters and histograms, residency of idle adapters, engine
gauges, and vLLM's `vllm:lora_requests_info` for LoRA-affinity routers."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _value(samples, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_metrics_after_known_workload(material, live_server):
    server = live_server(max_loras=2)
    server.load("a0", material.adapters["a0"])
    server.load("a1", material.adapters["a1"])
    server.load("a2", material.adapters["a2"], preload=False)
    base = server.serving.model_name
    client = server.client()
    prompt = "Colors of the garden:"
    num_prompt = len(server.encode(prompt))
    for _ in range(3):
        client.completions.create(model="a0", prompt=prompt, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    for _ in range(2):
        list(client.completions.create(model=base, prompt=prompt, max_tokens=3, stream=True,
                                       extra_body={"ignore_eos": True}))

    status, body = server.get("/metrics")
    assert status == 200
    s = _samples(body.decode())
    assert _value(s, "kubelora_requests_total", adapter="a0", finish_reason="length") == 3
    assert _value(s, "kubelora_requests_total", adapter=base, finish_reason="length") == 2
    assert _value(s, "kubelora_generation_tokens_total", adapter="a0") == 15
    assert _value(s, "kubelora_generation_tokens_total", adapter=base) == 6
    assert _value(s, "kubelora_prompt_tokens_total", adapter="a0") == 3 * num_prompt
    assert _value(s, "kubelora_time_to_first_token_seconds_count", adapter="a0") == 3
    assert _value(s, "kubelora_time_per_output_token_seconds_count", adapter=base) == 2
    queued, prefill = (f"kubelora_request_{part}_time_seconds" for part in ("queue", "prefill"))
    for name in (queued, prefill):
        assert _value(s, f"{name}_count", adapter="a0") == 3 and _value(s, f"{name}_count", adapter=base) == 2
    # The two parts of each request's time to first token add up to it.
    parts = _value(s, f"{queued}_sum", adapter="a0") + _value(s, f"{prefill}_sum", adapter="a0")
    assert abs(parts - _value(s, "kubelora_time_to_first_token_seconds_sum", adapter="a0")) < 1e-6
    for name in ("a0", "a1", "a2"):
        assert _value(s, "kubelora_adapter_load_seconds_count", adapter=name) == 1
        assert _value(s, "kubelora_requests_running", adapter=name) == 0  # idle adapters are listed too
        assert _value(s, "kubelora_requests_waiting", adapter=name) == 0
    for name, tier in (("a0", "device"), ("a1", "host"), ("a2", "known")):
        for t in ("known", "host", "device"):
            assert _value(s, "kubelora_adapter_residency", adapter=name, tier=t) == (t == tier)
    a0 = server.serving.adapters.get("a0")
    assert _value(s, "kubelora_adapter_info", adapter="a0", revision=a0.revision, rank="4") == 1
    assert _value(s, "kubelora_adapter_device_bytes", adapter="a0") == a0.bytes
    assert _value(s, "kubelora_adapter_host_bytes", adapter="a2") == 0
    assert _value(s, "kubelora_adapter_pool_bytes", state="used") == a0.bytes
    snapshot = server.serving.engine.snapshot()
    assert _value(s, "kubelora_adapter_pool_bytes", state="free") == snapshot.adapter_pool_total_bytes - a0.bytes
    assert _value(s, "kubelora_adapter_loads_total") == 2  # a0 and a1 staged in host memory; a2 only known
    for name in ("a0", "a1"):  # every host load is labelled with its adapter, on demand ones too
        assert _value(s, "kubelora_adapter_host_load_seconds_count", adapter=name) == 1
    assert _value(s, "kubelora_adapter_evictions_total", tier="device") == 0
    assert _value(s, "kubelora_engine_steps_total") >= 3 * 5
    assert _value(s, "kubelora_kv_cache_usage_ratio") == 0
    # Nothing runs after the workload: vLLM lists adapters with requests running or waiting, not resident ones.
    assert _value(s, "vllm:lora_requests_info", max_lora="2", running_lora_adapters="",
                  waiting_lora_adapters="") > 0
    assert _value(s, "vllm:lora_adapter_loaded", adapter_name="a0", level="gpu", pinned="false") == 1
    assert _value(s, "vllm:lora_adapter_loaded", adapter_name="a2", level="disk", pinned="false") == 1
    assert _value(s, "vllm:num_requests_running", model_name=base) == 0
    assert _value(s, "vllm:num_requests_waiting", model_name=base) == 0

    # A second scrape does not count the same host loads twice.
    s = _samples(server.get("/metrics")[1].decode())
    for name in ("a0", "a1"):
        assert _value(s, "kubelora_adapter_host_load_seconds_count", adapter=name) == 1


def _view(running: dict, waiting: dict, sizes: dict, pool_bytes: int):
    from dataclasses import replace

    from kubelora.engine.adapters.types import AdapterInfo
    from kubelora.engine.outputs import EngineSnapshot
    from kubelora.engine.server.metrics import EngineView

    snapshot = EngineSnapshot(num_running=running, num_waiting=waiting, last_batch_size=0, last_batch_tokens=0,
                              last_batch_adapters=0, kv_cache_usage=0.0, num_kv_blocks=1, adapter_pool_used_bytes=0,
                              adapter_pool_total_bytes=pool_bytes, adapter_host_bytes=0, num_adapter_loads=0,
                              num_adapter_load_failures=0, num_device_evictions=0, num_host_evictions=0,
                              adapter_load_latencies_s=(), num_preemptions=0, num_steps=0)
    template = AdapterInfo(name="", revision="r", path="/p", tier="device", rank=8, ranks={}, targets=(), bytes=0,
                           host_bytes=0, loaded_at=0.0, base_model="m", num_refs=0, is_loading=False,
                           is_unloading=False, last_error=None)
    return EngineView(snapshot=snapshot, adapters=[replace(template, name=n, bytes=b) for n, b in sizes.items()])


def test_vllm_lora_info_lists_running_and_waiting_and_the_budget_in_adapters():
    from kubelora.engine.server.metrics import _vllm_families

    view = _view(running={"": 2, "a": 1, "b": 3}, waiting={"b": 1, "c": 2, "": 4},
                 sizes={"a": 100, "b": 300, "c": 200, "d": 100}, pool_bytes=1000)
    info = next(_vllm_families(view, "base", None)).samples[0].labels
    # 1000 pool bytes over the running adapters' mean size (200): 5 adapters fit.
    assert info == {"max_lora": "5", "running_lora_adapters": "a,b", "waiting_lora_adapters": "c"}
    assert next(_vllm_families(view, "base", 3)).samples[0].labels["max_lora"] == "3"  # a count limit caps it
    idle = _view(running={}, waiting={}, sizes={"a": 250}, pool_bytes=1000)
    assert next(_vllm_families(idle, "base", None)).samples[0].labels["max_lora"] == "4"  # resident sizes then
    full = _view(running={"a": 1, "b": 1}, waiting={}, sizes={"a": 900, "b": 900}, pool_bytes=1000)
    assert next(_vllm_families(full, "base", None)).samples[0].labels["max_lora"] == "2"  # never below running
