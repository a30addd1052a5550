"""CUDA smoke tests (marker gpu: deselected without a GPU): the same PEFT equivalence on the device with each LoRA backend,
and bf16 close to float32. Run on a GPU machine: `python -P -m pytest tests/test_engine/test_cuda.py -s`."""

from __future__ import annotations

import pytest
import torch

from kubelora.engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu
BATCH = [None, "r4-qv", "r8-all", None, "r16-all-rs", "r32-attn", "r8-all"]
# float32 on the GPU: the torch backend matches to float32 rounding; Triton's tl.dot may use TF32.
TOLERANCE = {"torch": 1e-3, "triton": 3e-2}


def _generate(material, prompts, params, **options):
    llm = LLM(material.model_dir, max_loras=4, max_lora_rank=32, device="cuda", **options)
    for name, path in material.adapters.items():
        llm.load_adapter(name, path)
    try:
        return llm.generate(prompts, params, adapters=BATCH)
    finally:
        llm.close()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("material", ["llama", "qwen2"], indirect=True)
def test_cuda_float32_matches_transformers_peft(material, backend, prompt_ids, peft_reference):
    build_reference, reference_logits = peft_reference
    prompts = [prompt_ids(i, 5 + 3 * i) for i in range(len(BATCH))]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, return_logits=True)
    results = _generate(material, prompts, params, dtype="float32", lora_backend=backend)
    reference = build_reference(material)
    worst = 0.0
    for name, prompt, result in zip(BATCH, prompts, results):
        expected = reference_logits(reference, name, prompt + result.token_ids[:-1])
        got = torch.cat([result.prompt_logits, result.logits[1:]])
        worst = max(worst, float((got - expected).abs().max()))
        assert expected[len(prompt) - 1 :].argmax(-1).tolist() == result.token_ids, name
    print(f"\n{material.arch} cuda float32 backend={backend}: max |logit diff| = {worst:.2e}")
    assert worst < TOLERANCE[backend]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_bfloat16_close_to_float32(llama, backend, prompt_ids):
    prompts = [prompt_ids(i, 6 + 2 * i) for i in range(len(BATCH))]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, return_logits=True)
    fp32 = _generate(llama, prompts, params, dtype="float32", lora_backend="torch")
    bf16 = _generate(llama, prompts, params, dtype="bfloat16", lora_backend=backend)
    for a, b in zip(fp32, bf16):
        # The tiny random models have large weights (init range 0.25): bf16 rounding moves logits by ~5-7% of
        # their range on an H200 (measured); a broken LoRA path or cache moves them by far more.
        rel = float((a.prompt_logits - b.prompt_logits).abs().max() / a.prompt_logits.abs().max())
        assert rel < 0.15, rel


@pytest.mark.parametrize("material", ["llama", "qwen2"], indirect=True)
def test_cuda_long_prefill_through_fused_rotary_matches_transformers_peft(material, prompt_ids, peft_reference,
                                                                          monkeypatch):
    """Prompts long enough for tall LoRA tiles: the q/k/v deltas go through kernels/lora_rotary.py (base-model
    prompts and an adapter without k beside them) and the tokens still equal transformers+PEFT's."""
    from kubelora.engine.model import llama

    calls = []
    fused_op = llama.add_lora_rotary_kv_cache_
    monkeypatch.setattr(llama, "add_lora_rotary_kv_cache_", lambda *args: calls.append(1) or fused_op(*args))
    build_reference, reference_logits = peft_reference
    prompts = [prompt_ids(i, 120 + 7 * i) for i in range(len(BATCH))]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, return_logits=True)
    results = _generate(material, prompts, params, dtype="float32", lora_backend="triton")
    assert calls, "the prefill did not take the fused q/k/v LoRA + rotary launch"
    reference = build_reference(material)
    for name, prompt, result in zip(BATCH, prompts, results):
        expected = reference_logits(reference, name, prompt + result.token_ids[:-1])
        got = torch.cat([result.prompt_logits, result.logits[1:]])
        assert float((got - expected).abs().max()) < TOLERANCE["triton"], name
        assert expected[len(prompt) - 1 :].argmax(-1).tolist() == result.token_ids, name
