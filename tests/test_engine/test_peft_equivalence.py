"""The engine equals transformers + PEFT: prefill logits, >= 16 decode steps, greedy ids, any batch order."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from kubelora.engine import LLM, SamplingParams

TOL = 1e-4  # float32 max abs logit difference
NUM_DECODE = 18
# 4 adapters of ranks 4/8/16/32 (attention-only and all-linear, one rsLoRA) mixed with base requests.
BATCH = [None, "r4-qv", "r8-all", None, "r16-all-rs", "r32-attn", "r8-all", None]


@pytest.fixture(scope="module")
def greedy():
    return SamplingParams(max_tokens=NUM_DECODE, temperature=0.0, ignore_eos=True, return_logits=True)


def run_engine(material, prompts, names, params, **options):
    llm = LLM(material.model_dir, max_loras=4, max_lora_rank=32, **options)
    for name, path in material.adapters.items():
        llm.load_adapter(name, path)
    try:
        return llm.generate(prompts, params, adapters=names)
    finally:
        llm.close()


@pytest.mark.parametrize("material", ["llama", "mistral", "qwen2"], indirect=True)
def test_mixed_batch_matches_transformers_peft(material, greedy, prompt_ids, peft_reference):
    prompts = [prompt_ids(i, 5 + 3 * i) for i in range(len(BATCH))]
    results = run_engine(material, prompts, BATCH, greedy)
    build_reference, reference_logits = peft_reference
    reference = build_reference(material)
    for name, prompt, result in zip(BATCH, prompts, results):
        assert result.finish_reason == "length" and len(result.token_ids) == NUM_DECODE
        expected = reference_logits(reference, name, prompt + result.token_ids[:-1])
        num_prompt = len(prompt)
        assert (result.prompt_logits - expected[:num_prompt]).abs().max() < TOL, name
        assert (result.logits - expected[num_prompt - 1 :]).abs().max() < TOL, name
        assert expected[num_prompt - 1 :].argmax(-1).tolist() == result.token_ids, name


def test_adapters_change_the_output(llama_llm, prompt_ids):
    """Guards the equivalence test against a no-op LoRA path: each adapter moves the logits."""
    prompt = prompt_ids(3, 9)
    params = SamplingParams(max_tokens=2, temperature=0.0, return_logits=True)
    names = [None, *llama_llm.engine.adapters.list()]
    results = llama_llm.generate([prompt] * len(names), params, adapters=[n if n is None else n.name for n in names])
    base = results[0].prompt_logits
    for result in results[1:]:
        assert (result.prompt_logits - base).abs().max() > 1e-2, result.adapter


def test_batch_order_does_not_matter(llama_llm, greedy, prompt_ids):
    prompts = [prompt_ids(i, 4 + 2 * i) for i in range(len(BATCH))]
    first = llama_llm.generate(prompts, greedy, adapters=BATCH)
    order = list(range(len(BATCH)))
    random.Random(7).shuffle(order)
    shuffled = llama_llm.generate([prompts[i] for i in order], greedy, adapters=[BATCH[i] for i in order])
    for position, i in enumerate(order):
        assert shuffled[position].token_ids == first[i].token_ids
        assert (shuffled[position].logits - first[i].logits).abs().max() < 1e-5


def test_chunked_prefill_equals_unchunked(llama, greedy, prompt_ids):
    prompts = [prompt_ids(i, 20 + 9 * i) for i in range(4)]
    names = [None, "r8-all", "r32-attn", "r4-qv"]
    whole = run_engine(llama, prompts, names, greedy)
    chunked = run_engine(llama, prompts, names, greedy, max_num_batched_tokens=7, kv_block_size=4)
    for a, b in zip(whole, chunked):
        assert a.token_ids == b.token_ids
        assert (a.prompt_logits - b.prompt_logits).abs().max() < TOL
        assert (a.logits - b.logits).abs().max() < TOL


def test_sharded_checkpoint_loads_the_same(llama, tmp_path, greedy, prompt_ids):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(llama.model_dir).save_pretrained(sharded, max_shard_size="100KB")
    AutoTokenizer.from_pretrained(llama.model_dir).save_pretrained(sharded)
    assert (sharded / "model.safetensors.index.json").exists()
    prompts = [prompt_ids(0, 8)]
    single = run_engine(llama, prompts, ["r8-all"], greedy)
    llm = LLM(sharded, max_loras=1, max_lora_rank=32)
    llm.load_adapter("r8-all", llama.adapters["r8-all"])
    from_shards = llm.generate(prompts, greedy, adapters=["r8-all"])
    assert from_shards[0].token_ids == single[0].token_ids
    assert (from_shards[0].logits - single[0].logits).abs().max() < 1e-6


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_float32(llama, prompt_ids, dtype):
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, return_logits=True)
    prompts = [prompt_ids(i, 10) for i in range(3)]
    names = [None, "r16-all-rs", "r4-qv"]
    fp32 = run_engine(llama, prompts, names, params)
    half = run_engine(llama, prompts, names, params, dtype=dtype)
    for a, b in zip(fp32, half):
        scale = a.prompt_logits.abs().max()
        assert (a.prompt_logits - b.prompt_logits).abs().max() < 0.05 * scale


def test_sliding_window_attention_matches_transformers(mistral, tmp_path, greedy, prompt_ids):
    """Mistral with a window shorter than the sequences: the paged mask must equal transformers' one."""
    import json

    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "windowed"
    shutil.copytree(mistral.model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["sliding_window"] = 6
    (model_dir / "config.json").write_text(json.dumps(config))
    prompts = [prompt_ids(i, 9 + 5 * i) for i in range(3)]
    llm = LLM(model_dir, max_loras=1, max_lora_rank=8, kv_block_size=4)
    results = llm.generate(prompts, greedy)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, result in zip(prompts, results):
        with torch.no_grad():
            expected = reference(torch.tensor([prompt + result.token_ids[:-1]])).logits[0]
        got = torch.cat([result.prompt_logits, result.logits[1:]])
        assert (got - expected).abs().max() < TOL
