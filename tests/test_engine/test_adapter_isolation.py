"""Requests keep their own adapter's outputs while other tenants' adapters are loaded, evicted, unloaded and
reloaded in place around them: in-flight requests finish on the revision they started with. (An adapter whose
device rows hold NaN or infinities: tests/test_kernels/test_engine_isolation.py, on each LoRA backend.)"""

from __future__ import annotations

import shutil

import torch
from safetensors.torch import load_file, save_file

from kubelora.engine import LLM, SamplingParams
from kubelora.engine.adapters.pool import DeviceLoRAPool

MAX_TOKENS = 12
# In rank rows of every module: A (r4 q/v: 1), B (r8 all: 8.6), C (r32 attention: 14.2) and B's new revision fit,
# D (r16 all: 16.6) beside them does not: D is evicted
POOL_ROWS = 40


def negated_copy(src, dst):
    """A new revision of an adapter: the same files with every lora_B negated."""
    shutil.copytree(src, dst)
    weights = dst / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    save_file({k: -t if "lora_B" in k else t for k, t in tensors.items()}, str(weights))
    return dst


def new_llm(llama) -> LLM:
    pool_bytes = POOL_ROWS * DeviceLoRAPool.bytes_per_rank(_model_config(llama), torch.float32)
    return LLM(llama.model_dir, max_loras=4, max_lora_rank=32, max_lora_pool_bytes=pool_bytes, max_cpu_loras=8)


def _model_config(llama):
    from kubelora.engine.model.config import load_hf_config, model_config_from_hf

    return model_config_from_hf(load_hf_config(llama.model_dir), llama.model_dir)


def alone(llama, adapters: dict, requests: dict) -> dict[str, list[int]]:
    """Each request's tokens when it runs by itself: request id -> tokens; requests: id -> (adapter, prompt)."""
    llm = new_llm(llama)
    try:
        for name, path in adapters.items():
            llm.load_adapter(name, path)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        return {rid: llm.generate([prompt], params, adapters=name)[0].token_ids
                for rid, (name, prompt) in requests.items()}
    finally:
        llm.close()


def step_until(llm, tokens: dict[str, list[int]], done: set[str], num_steps: int | None = None) -> None:
    """Step the engine num_steps times (None: until every request has finished), collecting new tokens."""
    steps = 0
    while (num_steps is None and len(done) < len(tokens)) or (num_steps is not None and steps < num_steps):
        for output in llm.engine.step():
            assert output.error is None, output.error
            tokens[output.request_id].extend(output.new_token_ids)
            if output.finished:
                done.add(output.request_id)
        steps += 1


def test_in_flight_requests_keep_their_revision_while_others_churn(llama, tmp_path, prompt_ids):
    paths = {"A": llama.adapters["r4-qv"], "B": llama.adapters["r8-all"], "C": llama.adapters["r32-attn"],
             "D": llama.adapters["r16-all-rs"]}
    b_new = negated_copy(paths["B"], tmp_path / "b-new")
    requests = {"a1": ("A", prompt_ids(1, 9)), "b1": ("B", prompt_ids(2, 7)), "c1": ("C", prompt_ids(3, 6)),
                "b2": ("B", prompt_ids(4, 8))}
    expected = alone(llama, {**paths, "B-new": b_new},
                     {**requests, "b2": ("B-new", requests["b2"][1])})
    llm = new_llm(llama)
    try:
        for name in ("A", "B", "D"):
            llm.load_adapter(name, paths[name])
        llm.generate([prompt_ids(5, 4)], SamplingParams(max_tokens=2), adapters="D")
        assert llm.engine.adapters.get("D").tier == "device"
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        tokens: dict[str, list[int]] = {rid: [] for rid in requests}
        done: set[str] = set()
        for rid in ("a1", "b1"):
            llm.engine.add_request(rid, requests[rid][1], params, requests[rid][0])
        step_until(llm, tokens, done, num_steps=4)  # a prefill and three decode steps
        llm.load_adapter("C", paths["C"])
        old_b = llm.engine.adapters.get("B").revision
        assert llm.load_adapter("B", b_new, load_inplace=True).revision != old_b
        for rid in ("c1", "b2"):
            llm.engine.add_request(rid, requests[rid][1], params, requests[rid][0])
        step_until(llm, tokens, done, num_steps=3)
        assert llm.unload_adapter("C")  # c1 is in flight: it finishes on C
        step_until(llm, tokens, done)
        assert llm.engine.adapters.stats().num_device_evictions >= 1
        assert llm.engine.adapters.get("C") is None and llm.engine.adapters.get("B").revision != old_b
    finally:
        llm.close()
    assert tokens == expected
    assert expected["b1"] != expected["b2"]  # the revisions differ: b1 finished on the old one

