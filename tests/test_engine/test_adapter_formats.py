"""Adapters as PEFT writes them beyond plain LoRA, equal to transformers + PEFT on tiny models: DoRA, LoRA on
embed_tokens and lm_head (with and without PEFT's full embedding copies), in one mixed batch with plain LoRA, greedy
tokens and logprobs one prompt at a time; what is not served is refused naming the key; and the device pool, paged
per module, holds every adapter mix whose reported bytes fit its reported room."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kubelora.engine import LLM, SamplingParams
from kubelora.engine import errors

TOL = 1e-4  # float32 max abs logit difference
NUM_DECODE = 6
LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (LoraConfig arguments, save_embedding_layers)
ADAPTERS = {
    "plain": (dict(r=8, lora_alpha=16, target_modules=LINEAR), True),
    "dora": (dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"], use_dora=True),
             True),
    "dora-all": (dict(r=8, lora_alpha=8, target_modules=LINEAR, use_dora=True, use_rslora=True), True),
    "vocab": (dict(r=8, lora_alpha=16, target_modules=["q_proj", "embed_tokens", "lm_head"]), True),
    "vocab-only": (dict(r=4, lora_alpha=4, target_modules=["embed_tokens", "lm_head"]), False),
}
BATCH = [None, "plain", "dora", "vocab", "dora-all", "vocab-only", "dora", "vocab"]


def make_peft_adapter(out: Path, model_dir: Path, seed: int, config: dict, save_embedding_layers) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(lora_dropout=0.0, task_type="CAUSAL_LM", **config))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_magnitude_vector" in name:  # PEFT starts it at ||W||: moved so that DoRA changes the output
                param.mul_(1 + 0.3 * torch.rand(param.shape, generator=generator))
            elif "lora_" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=generator) / config["r"] ** 0.5)
    model.save_pretrained(out, save_embedding_layers=save_embedding_layers)
    return out


@pytest.fixture(scope="module")
def formats(tmp_path_factory):
    """arch -> Material with the ADAPTERS, built on first use."""
    from kubelora.cli.tiny import make_tiny_model

    from .conftest import Material

    built = {}

    def build(arch: str) -> Material:
        if arch not in built:
            root = tmp_path_factory.mktemp(arch)
            model_dir = make_tiny_model(root / "model", arch=arch, seed=0, num_layers=2)
            adapters = {name: make_peft_adapter(root / name, model_dir, seed, config, save)
                        for seed, (name, (config, save)) in enumerate(ADAPTERS.items(), start=1)}
            built[arch] = Material(arch, model_dir, adapters)
        return built[arch]

    return build


def generate(material, prompts, names, **options):
    llm = LLM(material.model_dir, max_loras=len(ADAPTERS), max_lora_rank=8, **options)
    try:
        for name, path in material.adapters.items():
            llm.load_adapter(name, path)
        params = SamplingParams(max_tokens=NUM_DECODE, temperature=0.0, ignore_eos=True, return_logits=True)
        return llm.generate(prompts, params, adapters=names)
    finally:
        llm.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
@pytest.mark.parametrize("options", [{}, {"enforce_eager": True}], ids=["static", "eager"])
def test_mixed_formats_match_transformers_peft(arch, options, formats, prompt_ids, peft_reference):
    material = formats(arch)
    prompts = [prompt_ids(i, 5 + 2 * i) for i in range(len(BATCH))]
    results = generate(material, prompts, BATCH, **options)
    build_reference, reference_logits = peft_reference
    reference = build_reference(material)
    for name, prompt, result in zip(BATCH, prompts, results):
        expected = reference_logits(reference, name, prompt + result.token_ids[:-1])
        num_prompt = len(prompt)
        assert expected[num_prompt - 1 :].argmax(-1).tolist() == result.token_ids, name
        assert (result.prompt_logits - expected[:num_prompt]).abs().max() < TOL, name
        assert (result.logits - expected[num_prompt - 1 :]).abs().max() < TOL, name
        logprobs = torch.log_softmax(result.logits, -1)
        assert (logprobs - torch.log_softmax(expected[num_prompt - 1 :], -1)).abs().max() < 2 * TOL, name
