"""One tenant's adapter never changes another's outputs: with an adapter whose device pool rows hold NaN or
infinities (loads refuse such weights, so the test writes them into the pool), every other request of its batch,
and of a later batch on the KV blocks it wrote, keeps its tokens and logits bit for bit, on each LoRA backend:
on CPU the torch reference and the Triton kernels under the interpreter; on CUDA (marker gpu) both, with CUDA
graphs and staged shrinks as the engine sets them up by default."""

from __future__ import annotations

import math

import pytest
import torch

from kubelora.engine.adapters.types import Residency
from lora_problems import write_tiny

ADAPTERS = {"r3-qv": (3, 6, "q_proj,v_proj"), "r12-all": (12, 24, "all-linear"),
            "r24-attn": (24, 16, "q_proj,k_proj,v_proj,o_proj"), "bad": (16, 8, "all-linear")}
MIXED = [None, "r3-qv", "bad", "r12-all", "bad", "r24-attn", None, "r12-all"]
VICTIMS = [name for name in MIXED if name != "bad"]
HAS_CUDA = torch.cuda.is_available()
RUNS = [("cpu", "torch"), *([] if HAS_CUDA else [("cpu", "triton")]),  # Triton on CPU: the interpreter only
        pytest.param("cuda", "torch", marks=pytest.mark.gpu), pytest.param("cuda", "triton", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("engine-isolation"), ADAPTERS)


def poison_resident(llm, name: str, value: float) -> None:
    """Make adapter `name` resident and set every one of its pool rows (A and B, all layers) to `value`."""
    manager = llm.engine.adapters
    revision = manager.acquire(name)
    try:
        assert manager.ensure_device(revision, set()) is Residency.RESIDENT
        manager._pool.fill(revision.id, value)
    finally:
        manager.release(revision)


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("device, backend", RUNS)
def test_poisoned_adapter_leaves_other_requests_alone(triton_backend, tiny, device, backend, value):
    from kubelora.engine import LLM, SamplingParams

    model_dir, adapters = tiny
    prompts = [[1] + [(17 + 31 * i + 7 * j) % 490 + 10 for j in range(3 + 9 * (i % 3))] for i in range(len(MIXED))]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, return_logits=True)
    llm = LLM(model_dir, device=device, dtype="float32", lora_backend=backend, max_loras=4, max_lora_rank=24)
    try:
        for name, path in adapters.items():
            llm.load_adapter(name, path)
        clean = llm.generate(prompts, params, adapters=MIXED)
        alone = llm.generate(prompts[: len(VICTIMS)], params, adapters=VICTIMS)
        poison_resident(llm, "bad", value)
        mixed = llm.generate(prompts, params, adapters=MIXED)
        after = llm.generate(prompts[: len(VICTIMS)], params, adapters=VICTIMS)  # on the KV blocks "bad" wrote
    finally:
        llm.close()
    for name, want, got in zip(MIXED, clean, mixed):
        if name == "bad":  # the poison reaches its own requests, which the engine ends on non-finite logits
            assert got.finish_reason == "error" and "not finite" in got.error
        else:
            assert_same(got, want, device, backend, name)
    for name, want, got in zip(VICTIMS, alone, after):
        assert_same(got, want, device, backend, name)


def assert_same(got, want, device: str, backend: str, name: str) -> None:
    """Tokens equal, logits bit for bit; on CUDA the torch path's per-slot matmuls run through cuBLAS, whose kernel
    (and so its rounding) follows the number of rows: once the poisoned requests end, the batch has fewer, so there
    the logits match to float32 rounding (a leaked NaN or infinity would not)."""
    assert got.token_ids == want.token_ids, name
    if device == "cuda" and backend == "torch":
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4, msg=name)
    else:
        assert torch.equal(got.logits, want.logits), name
