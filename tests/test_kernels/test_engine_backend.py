"""The engine with KUBELORA_LORA_BACKEND=triton (Triton's CPU interpreter, float32) gives the outputs of the
torch backend: a tiny Llama (GQA: q 64 wide, k/v 32), adapters of odd ranks 3, 12 and 24 on attention and
MLP projections, a mixed batch with base-model requests, a prompt long enough for prefill-shaped tiles."""

from __future__ import annotations

import pytest
import torch

from kubelora.kernels.lora import BACKEND_ENV

# name -> (rank, alpha, targets)
ADAPTERS = {
    "r3-qv": (3, 6, "q_proj,v_proj"),
    "r12-all": (12, 24, "all-linear"),
    "r24-attn": (24, 16, "q_proj,k_proj,v_proj,o_proj"),
}
PROMPT_LENGTHS = [4, 9, 70, 5, 20, 3, 12]  # 70: a slot group over 16 tokens, several tiles of one slot
BATCH = [None, "r3-qv", "r12-all", "r24-attn", "r12-all", None, "r3-qv"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from kubelora.cli.tiny import make_adapter, make_tiny_model

    root = tmp_path_factory.mktemp("engine-backend")
    model_dir = make_tiny_model(root / "model", arch="llama", seed=0)
    adapters = {name: make_adapter(root / name, model_dir, rank=rank, alpha=alpha, targets=targets, seed=seed)
                for seed, (name, (rank, alpha, targets)) in enumerate(ADAPTERS.items(), start=1)}
    return model_dir, adapters


def generate(tiny, monkeypatch, backend: str):
    from kubelora.engine import LLM, SamplingParams

    monkeypatch.setenv(BACKEND_ENV, backend)
    model_dir, adapters = tiny
    llm = LLM(model_dir, max_loras=3, max_lora_rank=24, device="cpu", dtype="float32")
    try:
        for name, path in adapters.items():
            llm.load_adapter(name, path)
        prompts = [[1] + [(17 + 31 * i + 7 * j) % 490 + 10 for j in range(n)] for i, n in enumerate(PROMPT_LENGTHS)]
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, return_logits=True)
        return llm.generate(prompts, params, adapters=BATCH)
    finally:
        llm.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the engine on CPU needs Triton's interpreter (set without CUDA)")
def test_triton_backend_matches_torch_backend(triton_backend, monkeypatch, tiny):
    torch.set_num_threads(1)
    calls = []
    kernel_op = triton_backend.add_lora_triton
    monkeypatch.setattr(triton_backend, "add_lora_triton", lambda *args: calls.append(1) or kernel_op(*args))
    expected = generate(tiny, monkeypatch, "torch")
    assert not calls
    got = generate(tiny, monkeypatch, "triton")
    assert calls, "the engine did not take the triton backend from KUBELORA_LORA_BACKEND"
    for name, want, have in zip(BATCH, expected, got):
        assert have.token_ids == want.token_ids, name
        torch.testing.assert_close(have.prompt_logits, want.prompt_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(have.logits, want.logits, rtol=1e-4, atol=1e-4)
