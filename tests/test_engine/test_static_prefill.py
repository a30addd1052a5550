"""The static prefill path (one sequence's chunk padded to a token bucket, what prefill CUDA graphs replay over),
run on CPU against the eager engine; graphs stood in for by a replay that reruns the captured forward into its
static output (`cpu_graphs`: the path's bookkeeping, which chunks take it, idle capture, the static logits)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kubelora.engine import LLM, SamplingParams
from kubelora.engine.step.executor import StepExecutor
from kubelora.engine.step.inputs import Step, StepInputs
from kubelora.engine.step.shape import TILE_M, LoRAShape, Phase, prefill_buckets, prefill_shape
from kubelora.kernels.lora import TILE_HEAD

ADAPTERS = [None, "r4-qv", "r8-all", "r16-all-rs", "r32-attn"]


def test_buckets_cover_the_step_budget_in_whole_tiles():
    assert prefill_buckets(2048) == [16, 32, 64, 96, 128, 192, 256, 384, 512]
    assert prefill_buckets(100) == [16, 32, 64, 96, 128]
    assert prefill_buckets(64) == [16, 32, 64]
    assert prefill_buckets(8) == [16]
    assert all(size % 16 == 0 for size in prefill_buckets(512))


def _tables(rank: list[int]) -> dict:
    return {"qkv": ([[40, 0, 40]], [rank], [[0.5, 0.0, 0.5]]), "o": ([[0]], [[0]], [[0.0]])}


def _lora(kinds: tuple[str, ...], lanes: int) -> LoRAShape:
    return LoRAShape(kinds, lanes, TILE_M)


def test_prefill_shape_is_the_adapted_kinds_and_rank_lanes():
    assert prefill_shape(16, None).lora is None
    assert prefill_shape(16, _tables([0, 0, 0])).lora is None
    assert prefill_shape(32, _tables([20, 0, 20])).lora == _lora(("qkv",), 32)


def _chunk(token_ids: list[int], start_pos: int, block_table: tuple[int, ...], tables) -> Step:
    return Step(token_ids=np.asarray(token_ids), query_lens=[len(token_ids)], start_pos=[start_pos],
                block_tables=[block_table], seq_slots=[0], slot_tables=tables, logits_rows=[len(token_ids) - 1])


def test_fill_pads_tokens_and_cuts_the_chunk_into_tiles():
    inputs = StepInputs(max_tokens=64, max_seqs=4, max_blocks=5, block_size=8, pad_block=9,
                        kind_slices={"qkv": 3, "o": 1}, device=torch.device("cpu"))
    step = _chunk(list(range(100, 120)), 5, (3, 6, 2, 5), _tables([20, 0, 20]))
    extent = inputs.static_extent(prefill_shape(32, step.slot_tables))
    inputs.fill(step, extent)
    ctx = inputs.context(extent, None)
    assert inputs.token_ids(extent).tolist() == list(range(100, 120)) + [0] * 12
    assert ctx.positions.tolist() == list(range(5, 25)) + [0] * 12
    meta = ctx.attention
    # positions 5..7 in block 3, 8..15 in block 6, 16..23 in block 2, 24 in block 5; padding on the pad block
    assert meta.slot_mapping.tolist() == [29, 30, 31] + list(range(48, 56)) + list(range(16, 24)) + [40] + [72] * 12
    assert meta.query_start_loc.tolist() == [0, 20] and meta.seq_lens.tolist() == [20]
    assert meta.context_lens.tolist() == [25] and meta.max_query_len == 32 and meta.is_padded
    assert meta.block_tables.tolist() == [[3, 6, 2, 5, 9]]
    assert inputs.logits_rows(extent).tolist() == [19]
    lora = ctx.lora.step
    assert lora.tiles.shape == (2, TILE_HEAD + 16) and lora.token_slots.tolist() == [0] * 20 + [-1] * 12
    tiles = lora.tiles.tolist()
    assert tiles[0][:3] == [0, 0, 16] and tiles[0][TILE_HEAD:] == list(range(16))
    assert tiles[1][:3] == [0, 16, 4] and tiles[1][TILE_HEAD : TILE_HEAD + 4] == list(range(16, 20))
    proj = ctx.lora.proj
    assert proj["qkv"].rank.tolist() == [[20, 0, 20], [0, 0, 0]] and proj["qkv"].max_rank == (32, 32, 32)
    assert proj["qkv"].scale[0].tolist() == [0.5, 0.0, 0.5] and proj["o"].max_rank == (0,)
    step = _chunk([7] * 3, 0, (1,), _tables([4, 0, 4]))
    extent = inputs.static_extent(prefill_shape(32, step.slot_tables))
    inputs.fill(step, extent)
    tiles = inputs.context(extent, None).lora.step.tiles.tolist()
    assert tiles[0][:3] == [0, 0, 3] and tiles[1][:3] == [1, 0, 0]  # the second tile empty, on the rank-0 slot


def _llm(llama, is_static: bool, **kwargs) -> LLM:
    """Prefix caching off: these tests count the prefill chunks of prompts they send again (test_prefix_cache.py
    runs static chunks after a cached prefix)."""
    llm = LLM(llama.model_dir, max_loras=4, max_lora_rank=32, max_cpu_loras=8, max_num_seqs=8,
              enforce_eager=not is_static, enable_prefix_caching=False, **kwargs)
    for name in ADAPTERS[1:]:
        llm.load_adapter(name, llama.adapters[name])
    return llm


def _one_at_a_time(llm: LLM, prompts, params: SamplingParams):
    """Each prompt alone (a batch of one sequence: the static prefill's case), its outputs."""
    return [llm.generate([p], params, adapters=[a])[0] for p, a in zip(prompts, ADAPTERS)]


def _spy_runs(monkeypatch) -> list[int]:
    """The token counts of the static prefill steps run."""
    calls = []
    run = StepExecutor.run

    def spy(self, step, pending=None, is_eager=False):
        shape = None if is_eager else self.shape(step)
        if shape is not None and shape.phase is Phase.PREFILL:
            calls.append(step.num_tokens)
        return run(self, step, pending, is_eager)

    monkeypatch.setattr(StepExecutor, "run", spy)
    return calls


PROMPTS = [[1] + [(11 + 7 * i + 5 * j) % 480 + 10 for j in range(n)] for i, n in enumerate((20, 3, 37, 15, 60))]


@pytest.mark.parametrize("max_num_batched_tokens", [2048, 24])  # 24: chunked prefills (a start past 0)
def test_static_prefill_gives_the_eager_tokens_and_logprobs(llama, monkeypatch, max_num_batched_tokens):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    eager_llm = _llm(llama, is_static=False, max_num_batched_tokens=max_num_batched_tokens)
    try:
        eager = _one_at_a_time(eager_llm, PROMPTS, params)
    finally:
        eager_llm.close()
    static_llm = _llm(llama, is_static=True, max_num_batched_tokens=max_num_batched_tokens)
    calls = _spy_runs(monkeypatch)
    try:
        assert static_llm.engine._runner.steps.buckets(Phase.PREFILL)
        static = _one_at_a_time(static_llm, PROMPTS, params)
    finally:
        static_llm.close()
    size = max_num_batched_tokens
    chunks = [n for p in PROMPTS for n in [size] * (len(p) // size) + [len(p) % size] if n]
    assert sorted(calls) == sorted(chunks)  # every prompt chunk took the static path
    for name, a, b in zip(ADAPTERS, eager, static):
        assert a.token_ids == b.token_ids, name
        for x, y in zip(a.logprobs, b.logprobs):
            assert [t.token_id for t in x.top] == [t.token_id for t in y.top], name
            assert x.chosen.logprob == pytest.approx(y.chosen.logprob, abs=1e-4), name


def test_prompt_logprobs_and_batches_take_the_eager_path(llama, monkeypatch):
    llm = _llm(llama, is_static=True)
    calls = _spy_runs(monkeypatch)
    try:
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, prompt_logprobs=1))
        llm.generate(PROMPTS[:2], SamplingParams(max_tokens=2), adapters=ADAPTERS[:2])
        assert calls == []
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2))
        assert calls == [len(PROMPTS[0])]
    finally:
        llm.close()


def test_adapter_graphs_are_captured_when_idle_and_replayed(llama, monkeypatch, cpu_graphs):
    """As on CUDA: base graphs from start-up; an adapter's chunk runs eagerly until the idle engine has captured
    its shape's graphs, then replays them with the eager tokens."""
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    llm = _llm(llama, is_static=True)
    calls = _spy_runs(monkeypatch)
    try:
        engine, static = llm.engine, llm.engine._runner.steps
        assert static.graphs.num_captures == len(static.buckets(Phase.DECODE)) + len(static.buckets(Phase.PREFILL))
        pending = [shape for shape in engine.pending_graphs() if shape.phase is Phase.PREFILL]
        shapes = {shape.lora for shape in pending}  # the two most common: every kind at 16 lanes, and one more
        assert len(shapes) == 2 and _lora(("qkv", "o", "gate_up", "down"), 16) in shapes
        assert {shape.bucket for shape in pending} == set(static.buckets(Phase.PREFILL))
        monkeypatch.setattr(llm, "capture_graphs", lambda: None)  # as a server's first requests meet the engine
        before = [r.token_ids for r in _one_at_a_time(llm, PROMPTS, params)]
        assert calls == [len(PROMPTS[0])]  # the base prompt only: no adapter graph yet
        while engine.capture_pending_graphs(budget_s=0.0):
            pass
        assert engine.pending_graphs() == [] and all(static.has_graph(shape) for shape in pending)
        calls.clear()
        after = [r.token_ids for r in _one_at_a_time(llm, PROMPTS, params)]
        keys = [None, _lora(("qkv",), 16)] + [_lora(("qkv", "o", "gate_up", "down"), 16)] * 2 + [
            _lora(("qkv", "o"), 32)]
        assert calls == [len(p) for p, key in zip(PROMPTS, keys) if key is None or key in shapes]
        assert after == before
    finally:
        llm.close()
