"""The engine's static decode path with staged shrinks (engine/adapters/staging.py: adapters' A rows beside the
q/k/v and o weights, one matmul for both) gives the tokens and logprobs of the torch backend's eager engine:
Triton's CPU interpreter, float32, a tiny Llama with GQA, adapters of odd ranks on attention, o alone and
all-linear, base-model rows in the batch; once with every step staged, once with a staging capacity small enough
that the first steps do not fit and run their shrink launches."""

from __future__ import annotations

import pytest
import torch

from kubelora.engine import setup
from kubelora.engine.adapters import staging
from lora_problems import count_calls, run_tiny, write_tiny

ADAPTERS = {"r3-qv": (3, 6, "q_proj,v_proj"), "r12-all": (12, 24, "all-linear"),
            "r24-attn": (24, 16, "q_proj,k_proj,v_proj,o_proj"), "r5-o": (5, 10, "o_proj")}
BATCH = [None, "r3-qv", "r12-all", "r24-attn", "r12-all", None, "r3-qv", "r5-o"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("staged-engine"), ADAPTERS)


def generate(tiny, monkeypatch, backend: str, is_static: bool, is_staged: bool, rows_per_slice: int = 64):
    from kubelora.engine import SamplingParams

    monkeypatch.setattr(setup, "ROWS_PER_SLICE", rows_per_slice)
    prompts = [[1] + [(17 + 31 * i + 7 * j) % 490 + 10 for j in range(3 + i % 4)] for i in range(len(BATCH))]
    # r24-attn's requests end first: with the small capacity the steps before that do not fit, those after do
    params = [SamplingParams(max_tokens=3 if name == "r24-attn" else 8, temperature=0.0, ignore_eos=True,
                             logprobs=0) for name in BATCH]

    def copies(llm) -> int:
        assert (llm.engine._staging is not None) == is_staged
        return llm.engine._staging.num_copies if is_staged else 0

    return run_tiny(tiny, prompts, params, BATCH, inspect=copies, max_loras=4, max_lora_rank=24, max_num_seqs=16,
                    lora_backend=backend, use_staged_shrink=is_staged, enforce_eager=not is_static)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the engine on CPU needs Triton's interpreter (set without CUDA)")
def test_staged_shrink_matches_the_torch_backend(triton_backend, monkeypatch, tiny):
    torch.set_num_threads(1)
    calls = count_calls(monkeypatch, triton_backend, "add_lora_staged_triton")
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
