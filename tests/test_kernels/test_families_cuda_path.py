"""The engine's CUDA path (Triton paged attention with windows and soft-caps, the fused norms with (1 + w), q/k
norms, GeGLU, rotary with per-layer bases, Triton LoRA) under Triton's CPU interpreter gives the reference path's
greedy tokens and logits for every newer family, with prompts longer than the sliding window and mixed adapters
(Phi-3's fused ones, its head_dim of 24 padded to 32 columns)."""

from __future__ import annotations

import pytest
import torch

from kubelora.engine.model import attention

PROMPT_LENGTHS = [13, 3, 10]
BATCH = [None, "r3-qv", "r8-all"]
FAMILIES = {"qwen3": {}, "gemma2": {}, "gemma3_text": {}, "phi3": {"hidden_size": 96}}


@pytest.fixture(scope="module")
def tiny_families(tmp_path_factory):
    from kubelora.cli.tiny import make_adapter, make_tiny_model

    built = {}

    def build(arch: str):
        if arch not in built:
            root = tmp_path_factory.mktemp(arch)
            model_dir = make_tiny_model(root / "model", arch=arch, seed=0, num_layers=3, **FAMILIES[arch])
            qv = "qkv_proj" if arch == "phi3" else "q_proj,v_proj"
            adapters = {"r3-qv": make_adapter(root / "a", model_dir, rank=3, alpha=6, targets=qv, seed=1),
                        "r8-all": make_adapter(root / "b", model_dir, rank=8, alpha=16, targets="all-linear", seed=2)}
            built[arch] = (model_dir, adapters)
        return built[arch]

    return build


def _generate(tiny, is_cuda_path: bool):
    """Greedy tokens and logits of the prompts in one batch, on the static path (what CUDA replays)."""
    from kubelora.engine import LLM, SamplingParams

    model_dir, adapters = tiny
    llm = LLM(model_dir, max_loras=2, max_lora_rank=8, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
              dtype="float32", lora_backend="triton" if is_cuda_path else "torch", use_staged_shrink=False)
    try:
        if is_cuda_path:
            llm.engine._runner.model.is_fused = True
        for name, path in adapters.items():
            llm.load_adapter(name, path)
        prompts = [[1] + [(11 * i + 7 * j) % 480 + 10 for j in range(n)] for i, n in enumerate(PROMPT_LENGTHS)]
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, return_logits=True)
        return llm.generate(prompts, params, adapters=BATCH)
    finally:
        llm.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA path on CPU needs Triton's interpreter")
@pytest.mark.parametrize("arch", list(FAMILIES))
def test_cuda_path_under_interpreter_matches_reference(arch, triton_backend, tiny_families, monkeypatch):
    expected = _generate(tiny_families(arch), is_cuda_path=False)
    monkeypatch.setattr(attention, "uses_triton", lambda query: True)
    for result, reference in zip(_generate(tiny_families(arch), is_cuda_path=True), expected):
        assert result.token_ids == reference.token_ids
        assert (result.logits - reference.logits).abs().max() < 1e-4
        assert (result.prompt_logits - reference.prompt_logits).abs().max() < 1e-4
