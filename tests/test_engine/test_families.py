"""Every served family (Qwen3, Gemma 2, Gemma 3 text, Phi-3) equals transformers + PEFT on tiny models: a mixed
batch over adapters of mixed ranks and targets (Phi-3's fused qkv_proj / gate_up_proj included) gives the reference's
greedy tokens and logits (so logprobs) within tolerance, with prompts longer than the sliding window. And configs the
engine cannot serve are refused at start-up naming the field."""

from __future__ import annotations

import json

import pytest
import torch

from kubelora.engine import LLM, SamplingParams

TOL = 1e-4  # float32 max abs logit difference
NUM_DECODE = 10
# name -> (rank, alpha, targets, use_rslora) per target style; Phi-3's modules are its fused ones
ADAPTERS = {
    "r4-qv": (4, 8, {"default": "q_proj,v_proj", "phi3": "qkv_proj"}, False),
    "r8-all": (8, 16, {"default": "all-linear"}, False),
    "r16-mlp-rs": (16, 8, {"default": "gate_proj,up_proj,down_proj", "phi3": "gate_up_proj,down_proj"}, True),
}
BATCH = [None, "r4-qv", "r8-all", "r16-mlp-rs", "r4-qv", None]
FAMILIES = ["qwen3", "gemma2", "gemma3_text", "phi3"]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """arch -> Material: a tiny model (3 layers, window 8) and its PEFT adapters, built on first use."""
    from kubelora.cli.tiny import make_adapter, make_tiny_model

    from .conftest import Material

    built = {}

    def build(arch: str) -> Material:
        if arch not in built:
            root = tmp_path_factory.mktemp(arch)
            model_dir = make_tiny_model(root / "model", arch=arch, seed=0, num_layers=3)
            adapters = {}
            for seed, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items(), start=1):
                target = targets.get(arch, targets["default"])
                adapters[name] = make_adapter(root / name, model_dir, rank=rank, alpha=alpha, targets=target,
                                              seed=seed, use_rslora=rslora)
            built[arch] = Material(arch, model_dir, adapters)
        return built[arch]

    return build


def generate(material, prompts, names, **options):
    llm = LLM(material.model_dir, max_loras=3, max_lora_rank=16, **options)
    try:
        for name, path in material.adapters.items():
            llm.load_adapter(name, path)
        params = SamplingParams(max_tokens=NUM_DECODE, temperature=0.0, ignore_eos=True, return_logits=True)
        return llm.generate(prompts, params, adapters=names)
    finally:
        llm.close()


def check_against_reference(material, prompts, results, peft_reference) -> None:
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


@pytest.mark.parametrize("arch", FAMILIES)
def test_mixed_batch_matches_transformers_peft(arch, families, prompt_ids, peft_reference):
    """Prompts of 12 to 27 tokens (the window is 8); Phi-3's sequences pass original_max_position_embeddings (32),
    so transformers runs them with longrope's long factors, as the engine does at the default max_model_len."""
    material = families(arch)
    prompts = [prompt_ids(i, 12 + 3 * i) for i in range(len(BATCH))]
    if arch == "phi3":
        prompts = [prompt_ids(i, 24 + 3 * i) for i in range(len(BATCH))]
    results = generate(material, prompts, BATCH)
    check_against_reference(material, prompts, results, peft_reference)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text", "phi3"])
def test_graph_replays_match_transformers_peft(arch, cpu_graphs, families, prompt_ids, peft_reference):
    """Decode steps and prefill chunks replayed from captured stand-in graphs (conftest's cpu_graphs), as on CUDA:
    the reference's greedy tokens. (Tokens only: on CPU a replay's logits are views the next replay overwrites.)"""
    material = families(arch)
    prompts = [prompt_ids(i, (24 if arch == "phi3" else 12) + 3 * i) for i in range(len(BATCH))]
    results = generate(material, prompts, BATCH)
    build_reference, reference_logits = peft_reference
    reference = build_reference(material)
    for name, prompt, result in zip(BATCH, prompts, results):
        expected = reference_logits(reference, name, prompt + result.token_ids[:-1])
        assert expected[len(prompt) - 1 :].argmax(-1).tolist() == result.token_ids, name


def test_phi3_short_factors_up_to_the_original_length(families, prompt_ids, peft_reference):
    """max_model_len <= original_max_position_embeddings: longrope's short factors, as transformers uses them for
    sequences that short."""
    material = families("phi3")
    prompts = [prompt_ids(i, 9 + 2 * i) for i in range(len(BATCH))]
    results = generate(material, prompts, BATCH, max_model_len=32)
    check_against_reference(material, prompts, results, peft_reference)


def test_adapters_move_every_family(families, prompt_ids):
    """Guards the equivalence against a LoRA path that adds nothing (Phi-3's fused adapters included)."""
    for arch in ("phi3", "gemma2"):
        results = generate(families(arch), [prompt_ids(3, 14)] * 4, [None, *ADAPTERS])
        for result in results[1:]:
            assert (result.prompt_logits - results[0].prompt_logits).abs().max() > 1e-2, (arch, result.adapter)


def _rewrite_config(material, tmp_path, **changes):
    """A copy of the model directory with config.json fields changed."""
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(material.model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(changes)
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


@pytest.mark.parametrize(("arch", "changes", "field"), [
    ("gemma2", {"hidden_activation": "relu"}, "hidden_act"),
    ("qwen3", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}}, "rope_type"),
    ("qwen3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
])
def test_unservable_config_is_refused_naming_the_field(arch, changes, field, families, tmp_path):
    model_dir = _rewrite_config(families(arch), tmp_path, **changes)
    with pytest.raises(ValueError, match=field):
        LLM(model_dir)


def test_unknown_model_type_is_refused_with_the_supported_ones():
    from kubelora.engine.model.config import model_config_from_hf
    from transformers import GPTNeoXConfig

    with pytest.raises(ValueError, match=r"model_type must be one of .*gemma2.*got 'gpt_neox'"):
        model_config_from_hf(GPTNeoXConfig(), "/m")


def test_llama_adapter_names_are_refused_on_phi3(families, tmp_path):
    """Phi-3 has no q_proj module: an adapter naming one targets nothing the base model has."""
    from kubelora.cli.tiny import make_adapter

    from kubelora.engine.errors import AdapterTargetUnsupported

    llama_style = make_adapter(tmp_path / "llama-style", families("gemma2").model_dir, rank=4, targets="q_proj")
    llm = LLM(families("phi3").model_dir, max_lora_rank=16)
    try:
        with pytest.raises(AdapterTargetUnsupported, match="q_proj.*cannot adapt in a phi3 model") as refused:
            llm.load_adapter("llama-style", llama_style)
        assert "qkv_proj" in refused.value.limit and "q_proj" not in refused.value.limit
    finally:
        llm.close()


@pytest.fixture(scope="module")
def gemma3_multimodal(tmp_path_factory):
    """A tiny multimodal Gemma 3 checkpoint (language model under language_model, a one-layer vision tower) and a PEFT
    adapter on its language model's q/v projections, with rank and alpha patterns."""
    from peft import LoraConfig, get_peft_model
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from kubelora.cli.tiny import TinyModelSpec, _perturb_defaults, build_config, build_tokenizer

    from .conftest import Material

    root = tmp_path_factory.mktemp("gemma3")
    tokenizer = build_tokenizer(512)
    text = build_config(TinyModelSpec(arch="gemma3_text", num_layers=3), tokenizer)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=500, boi_token_index=498, eoi_token_index=499)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config)
    _perturb_defaults(model.model.language_model, torch.Generator().manual_seed(1))
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    # pattern keys that name the language model: matched against its own module names
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|v_proj)", lora_dropout=0.0,
                      rank_pattern={r"language_model\.layers\.\d+\.self_attn\.v_proj": 6},
                      alpha_pattern={r"model\.language_model\.layers\.\d+\.self_attn\.q_proj": 32})
    peft_model = get_peft_model(model, lora)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    peft_model.save_pretrained(root / "adapter")
    return Material("gemma3", root / "model", {"r4-lm-qv": root / "adapter"})


def test_multimodal_gemma3_is_served_text_only(gemma3_multimodal, prompt_ids, peft_reference, caplog):
    """The language model of a multimodal checkpoint, and an adapter on it, equal transformers' multimodal model
    given text alone."""
    import logging

    names = [None, "r4-lm-qv"]
    prompts = [prompt_ids(i, 14 + 3 * i) for i in range(len(names))]
    with caplog.at_level(logging.INFO, logger="kubelora.engine.model.config"):
        llm = LLM(gemma3_multimodal.model_dir, max_lora_rank=8)
    assert "vision tower is not loaded" in caplog.text
    try:
        llm.load_adapter("r4-lm-qv", gemma3_multimodal.adapters["r4-lm-qv"])
        params = SamplingParams(max_tokens=NUM_DECODE, temperature=0.0, ignore_eos=True, return_logits=True)
        results = llm.generate(prompts, params, adapters=names)
    finally:
        llm.close()
    build_reference, reference_logits = peft_reference
    reference = build_reference(gemma3_multimodal)
    for name, prompt, result in zip(names, prompts, results):
        expected = reference_logits(reference, name, prompt + result.token_ids[:-1])
        assert expected[len(prompt) - 1 :].argmax(-1).tolist() == result.token_ids, name
        assert (result.logits - expected[len(prompt) - 1 :]).abs().max() < TOL, name
    assert results[0].token_ids != results[1].token_ids or (results[0].logits - results[1].logits).abs().max() > 1e-2


# ---- on the GPU (marker gpu: deselected without one) ----------------------------------------------------------

CUDA_TOLERANCE = 3e-2  # float32 logits: Triton's tl.dot may use TF32 (tests/test_engine/test_cuda.py)


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_cuda_mixed_batch_matches_transformers_peft(arch, enforce_eager, families, prompt_ids, peft_reference):
    """The CUDA path (graphs replayed, or every step eager): Triton attention, fused ops and LoRA kernels."""
    material = families(arch)
    prompts = [prompt_ids(i, (24 if arch == "phi3" else 12) + 3 * i) for i in range(len(BATCH))]
    results = generate(material, prompts, BATCH, device="cuda", dtype="float32", lora_backend="triton",
                       enforce_eager=enforce_eager)
    build_reference, reference_logits = peft_reference
    reference = build_reference(material, "cuda")
    for name, prompt, result in zip(BATCH, prompts, results):
        expected = reference_logits(reference, name, prompt + result.token_ids[:-1]).cpu()
        assert expected[len(prompt) - 1 :].argmax(-1).tolist() == result.token_ids, name
        got = torch.cat([result.prompt_logits, result.logits[1:]])
        assert float((got - expected).abs().max()) < CUDA_TOLERANCE, name


@pytest.mark.gpu
@pytest.mark.parametrize("arch", FAMILIES)
def test_cuda_bfloat16_close_to_float32(arch, families, prompt_ids):
    material = families(arch)
    prompts = [prompt_ids(i, (24 if arch == "phi3" else 12) + 3 * i) for i in range(len(BATCH))]
    fp32 = generate(material, prompts, BATCH, device="cuda", dtype="float32", lora_backend="torch")
    bf16 = generate(material, prompts, BATCH, device="cuda", dtype="bfloat16", lora_backend="triton")
    for a, b in zip(fp32, bf16):  # bf16 moves the tiny models' logits by ~5-7% of their range (test_cuda.py)
        rel = float((a.prompt_logits - b.prompt_logits).abs().max() / a.prompt_logits.abs().max())
        assert rel < 0.15, rel
