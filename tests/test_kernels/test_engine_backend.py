"""The engine with lora_backend="triton" (Triton's CPU interpreter, float32) gives the outputs of the
torch backend: a tiny Llama (GQA: q 64 wide, k/v 32), adapters of odd ranks 3, 12 and 24 on attention and
MLP projections, a mixed batch with base-model requests, a prompt long enough for prefill-shaped tiles."""

from __future__ import annotations

import pytest
import torch

from lora_problems import count_calls, run_tiny, write_tiny

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
    return write_tiny(tmp_path_factory.mktemp("engine-backend"), ADAPTERS)


def generate(tiny, monkeypatch, backend: str):
    from kubelora.engine import SamplingParams

    prompts = [[1] + [(17 + 31 * i + 7 * j) % 490 + 10 for j in range(n)] for i, n in enumerate(PROMPT_LENGTHS)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, return_logits=True)
    return run_tiny(tiny, prompts, params, BATCH, max_loras=3, max_lora_rank=24, lora_backend=backend)[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the engine on CPU needs Triton's interpreter (set without CUDA)")
def test_triton_backend_matches_torch_backend(triton_backend, monkeypatch, tiny):
    torch.set_num_threads(1)
    calls = count_calls(monkeypatch, triton_backend, "add_lora_triton")
    expected = generate(tiny, monkeypatch, "torch")
    assert not calls
    got = generate(tiny, monkeypatch, "triton")
    assert calls, "the engine did not take the triton backend from its config"
    for name, want, have in zip(BATCH, expected, got):
        assert have.token_ids == want.token_ids, name
        torch.testing.assert_close(have.prompt_logits, want.prompt_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(have.logits, want.logits, rtol=1e-4, atol=1e-4)
