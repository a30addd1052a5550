"""The engine's static decode path with staged shrinks (engine/adapters/staging.py: adapters' A rows beside the
q/k/v and o weights, one matmul for both) gives the outputs of the same path without staging
(KUBELORA_STAGED_SHRINK=0) and of the torch backend: Triton's CPU interpreter, float32, a tiny Llama with GQA,
adapters of odd ranks on attention and MLP, base-model rows in the batch, and a staging capacity small enough
that some steps do not fit and run their shrink launches instead."""

from __future__ import annotations

import pytest
import torch

from kubelora.engine import setup
from kubelora.engine.adapters import staging
from kubelora.kernels.lora import BACKEND_ENV

ADAPTERS = {"r3-qv": (3, 6, "q_proj,v_proj"), "r12-all": (12, 24, "all-linear"),
            "r24-attn": (24, 16, "q_proj,k_proj,v_proj,o_proj"), "r5-o": (5, 10, "o_proj")}
BATCH = [None, "r3-qv", "r12-all", "r24-attn", "r12-all", None, "r3-qv", "r5-o"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from kubelora.cli.tiny import make_adapter, make_tiny_model

    root = tmp_path_factory.mktemp("staged-engine")
    model_dir = make_tiny_model(root / "model", arch="llama", seed=0)
    adapters = {name: make_adapter(root / name, model_dir, rank=rank, alpha=alpha, targets=targets, seed=seed)
                for seed, (name, (rank, alpha, targets)) in enumerate(ADAPTERS.items(), start=1)}
    return model_dir, adapters


def generate(tiny, monkeypatch, backend: str, is_static: bool, is_staged: bool, rows_per_slice: int = 64):
    from kubelora.engine import LLM, SamplingParams

    monkeypatch.setenv(BACKEND_ENV, backend)
    monkeypatch.setenv(staging.STAGE_ENV, "1" if is_staged else "0")
    monkeypatch.setattr(setup, "uses_static_decode", lambda config: is_static)
    monkeypatch.setattr(setup, "ROWS_PER_SLICE", rows_per_slice)
    model_dir, adapters = tiny
    llm = LLM(model_dir, max_loras=4, max_lora_rank=24, max_num_seqs=16, device="cpu", dtype="float32")
    try:
        assert (llm.engine._staging is not None) == is_staged
        for name, path in adapters.items():
            llm.load_adapter(name, path)
        prompts = [[1] + [(17 + 31 * i + 7 * j) % 490 + 10 for j in range(3 + i % 4)] for i in range(len(BATCH))]
        # r24-attn's requests end first: with the small capacity the steps before that do not fit, those after do
        params = [SamplingParams(max_tokens=3 if name == "r24-attn" else 8, temperature=0.0, ignore_eos=True,
                                 logprobs=0) for name in BATCH]
        results = llm.generate(prompts, params, adapters=BATCH)
        return results, (llm.engine._staging.num_copies if is_staged else 0)
    finally:
        llm.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the engine on CPU needs Triton's interpreter (set without CUDA)")
def test_staged_shrink_matches_the_torch_backend(triton_backend, monkeypatch, tiny):
    torch.set_num_threads(1)
    calls = []
    staged_op = triton_backend.add_lora_staged_triton
    monkeypatch.setattr(triton_backend, "add_lora_staged_triton", lambda *args: calls.append(1) or staged_op(*args))
    expected, _ = generate(tiny, monkeypatch, "torch", is_static=False, is_staged=False)
    assert not calls
    runs = {}
    for rows_per_slice in (64, 32):  # every step fits; the steps before r24-attn's requests end do not
        calls.clear()
        results, copies = generate(tiny, monkeypatch, "triton", is_static=True, is_staged=True,
                                   rows_per_slice=rows_per_slice)
        assert calls and copies, "no decode step took the staged shrink"
        runs[rows_per_slice] = (results, len(calls))
        for name, want, have in zip(BATCH, expected, results):
            assert have.token_ids == want.token_ids, name
            got = [p.chosen.logprob for p in have.logprobs]
            torch.testing.assert_close(got, [p.chosen.logprob for p in want.logprobs], rtol=1e-4, atol=1e-4)
    assert runs[32][1] < runs[64][1], "every step staged, though the first ones lack the capacity"
