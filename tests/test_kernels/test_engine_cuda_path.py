"""The engine's CUDA path (the paged attention kernels, fused small ops, Triton LoRA; at each step's own sizes and
at static shapes) under Triton's CPU interpreter gives the reference path's greedy tokens, with chunked prefill, decode
rows mixed into prefill steps and mixed adapters."""

from __future__ import annotations

import pytest
import torch

from kubelora.engine.model import attention

PROMPT_LENGTHS = [19, 3, 9, 5]
BATCH = [None, "r3-qv", "r12-all", "r3-qv"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from kubelora.cli.tiny import make_adapter, make_tiny_model

    root = tmp_path_factory.mktemp("cuda-path")
    model_dir = make_tiny_model(root / "model", arch="mistral", seed=0)  # GQA and a sliding window
    adapters = {"r3-qv": make_adapter(root / "a", model_dir, rank=3, alpha=6, targets="q_proj,v_proj", seed=1),
                "r12-all": make_adapter(root / "b", model_dir, rank=12, alpha=24, targets="all-linear", seed=2)}
    return model_dir, adapters


def _generate(tiny, is_cuda_path: bool, is_static: bool = False, is_alone: bool = False):
    """Greedy tokens of the prompts in one batch, or each alone (is_alone: one-sequence prefills, which the
    static path runs from its prefill buffers)."""
    from kubelora.engine import LLM, SamplingParams

    model_dir, adapters = tiny
    llm = LLM(model_dir, max_loras=2, max_lora_rank=16, max_num_seqs=8, max_num_batched_tokens=16,
              max_model_len=128, dtype="float32", lora_backend="triton" if is_cuda_path else "torch",
              enforce_eager=not is_static, use_staged_shrink=False)  # staged shrinks: test_staged_engine.py
    engine = llm.engine
    try:
        if is_cuda_path:
            engine._runner.model.is_fused = True
        for name, path in adapters.items():
            llm.load_adapter(name, path)
        prompts = [[1] + [(11 * i + 7 * j) % 480 + 10 for j in range(n)] for i, n in enumerate(PROMPT_LENGTHS)]
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        if is_alone:
            return [llm.generate([p], params, adapters=[a])[0].token_ids for p, a in zip(prompts, BATCH)]
        return [r.token_ids for r in llm.generate(prompts, params, adapters=BATCH)]
    finally:
        llm.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA path on CPU needs Triton's interpreter")
def test_cuda_path_under_interpreter_matches_reference(triton_backend, tiny, monkeypatch):
    expected = _generate(tiny, is_cuda_path=False)
    monkeypatch.setattr(attention, "uses_triton", lambda query: True)
    assert _generate(tiny, is_cuda_path=True) == expected
    assert _generate(tiny, is_cuda_path=True, is_static=True) == expected
    alone = _generate(tiny, is_cuda_path=False, is_alone=True)
    assert _generate(tiny, is_cuda_path=True, is_static=True, is_alone=True) == alone
