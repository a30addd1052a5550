"""CUDA-graph decode (marker gpu: deselected without a GPU): the same greedy tokens with graphs on and off, and
the graphs' tokens equal transformers+PEFT's. Run with every GPU test: `make test-gpu` (bench/gpu-tests.sh)."""

from __future__ import annotations

import pytest
import torch

from kubelora.engine import LLM, SamplingParams
from kubelora.engine.step.shape import Phase

pytestmark = pytest.mark.gpu
# Base rows between adapters, and one adapter on more rows than a LoRA tile (16) holds.
BATCH = [None, "r4-qv", "r8-all", None, "r16-all-rs", "r32-attn", "r8-all"] + ["r4-qv"] * 17 + [None] * 3


def _generate(material, prompts, dtype: str, enforce_eager: bool, adapters=BATCH, async_scheduling=None):
    llm = LLM(material.model_dir, max_loras=4, max_lora_rank=32, max_num_seqs=32, device="cuda", dtype=dtype,
              enforce_eager=enforce_eager, async_scheduling=async_scheduling)
    for name, path in material.adapters.items():
        llm.load_adapter(name, path)
    try:
        static = llm.engine._runner.steps
        assert static.use_graphs != enforce_eager
        results = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                               adapters=adapters)
        return [r.token_ids for r in results], static
    finally:
        llm.close()


def _prompts(prompt_ids, count: int):
    return [prompt_ids(i, 3 + 5 * (i % 7)) for i in range(count)]


@pytest.mark.parametrize("material", ["llama", "qwen2"], indirect=True)
def test_graphs_give_the_eager_tokens_float32(material, prompt_ids):
    prompts = _prompts(prompt_ids, len(BATCH))
    eager, _ = _generate(material, prompts, "float32", enforce_eager=True)
    graphs, static = _generate(material, prompts, "float32", enforce_eager=False)
    num_base = len(static.buckets(Phase.DECODE)) + len(static.buckets(Phase.PREFILL))
    assert static.graphs.num_captures > num_base  # base graphs at start-up, LoRA graphs while idle or on first use
    assert graphs == eager


def test_graphs_match_transformers_peft(llama, prompt_ids, peft_reference):
    build_reference, reference_logits = peft_reference
    prompts = _prompts(prompt_ids, len(BATCH))
    tokens, _ = _generate(llama, prompts, "float32", enforce_eager=False)
    reference = build_reference(llama, device="cuda")
    for name, prompt, got in zip(BATCH, prompts, tokens):
        logits = reference_logits(reference, name, prompt + got[:-1])
        assert logits[len(prompt) - 1 :].argmax(-1).tolist() == got, name


def test_graphs_bfloat16_base_batch(llama, prompt_ids):
    prompts = _prompts(prompt_ids, 20)
    eager, _ = _generate(llama, prompts, "bfloat16", enforce_eager=True, adapters=None)
    graphs, _ = _generate(llama, prompts, "bfloat16", enforce_eager=False, adapters=None)
    same = sum(a == b for e, g in zip(eager, graphs) for a, b in zip(e, g))
    assert same >= 0.95 * sum(len(e) for e in eager)


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_overlapped_steps_give_the_tokens_of_sync_steps(llama, prompt_ids, enforce_eager):
    """Steps overlap by default on CUDA; each step read back at once gives the same tokens."""
    prompts = _prompts(prompt_ids, len(BATCH))
    sync, _ = _generate(llama, prompts, "float32", enforce_eager, async_scheduling=False)
    overlapped, _ = _generate(llama, prompts, "float32", enforce_eager, async_scheduling=True)
    assert overlapped == sync


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_graphs_give_the_eager_prefill_tokens(llama, prompt_ids, monkeypatch, dtype):
    """One request at a time (each prefill one sequence's, padded to its token bucket): the same greedy tokens
    with the prefill graphs as with eager prefills (use_prefill_graphs=False); each request's one prefill
    replayed a graph (generate captures the adapters' graphs first). Counted per request: start-up's own warm-up
    requests (engine/warmup.py) replay the base graph too, before any request of the test."""
    from kubelora.engine.step import plan
    from kubelora.engine.step.executor import StepExecutor

    monkeypatch.setattr(plan, "MAX_GRAPH_SHAPES", 3)  # graphs for each of the adapters' three shapes
    names = [None, "r4-qv", "r8-all", "r16-all-rs", "r32-attn"]
    prompts = [prompt_ids(i, n) for i, n in enumerate((5, 17, 40, 100, 300))]
    results, runs = {}, []
    run = StepExecutor.run

    def counted(self, step, pending=None, is_eager=False):
        shape = None if is_eager else self.shape(step)
        if shape is not None and shape.phase is Phase.PREFILL:
            runs.append(1)
        return run(self, step, pending, is_eager)

    monkeypatch.setattr(StepExecutor, "run", counted)
    for enabled in ("0", "1"):
        llm = LLM(llama.model_dir, max_loras=4, max_lora_rank=32, max_num_seqs=32, device="cuda", dtype=dtype,
                  use_prefill_graphs=enabled == "1")
        for name in names[1:]:
            llm.load_adapter(name, llama.adapters[name])
        try:
            assert bool(llm.engine._runner.steps.buckets(Phase.PREFILL)) == (enabled == "1")
            params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
            results[enabled] = []
            for prompt, name in zip(prompts, names):
                runs.clear()
                results[enabled].append(llm.generate([prompt], params, adapters=[name])[0].token_ids)
                assert len(runs) == (enabled == "1"), (name, len(prompt))
        finally:
            llm.close()
    if dtype == "float32":
        assert results["1"] == results["0"]
    else:  # bf16: a padded matmul may pick another kernel (other roundings); a near tie may flip one prompt
        assert sum(x[0] == y[0] for x, y in zip(results["1"], results["0"])) >= len(prompts) - 1
