"""Static decode steps (the inputs CUDA graphs replay over), run eagerly on CPU against the engine at each step's
own sizes (enforce_eager)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kubelora.engine import LLM, SamplingParams
from kubelora.engine import setup
from kubelora.engine.step.executor import StepExecutor
from kubelora.engine.step.inputs import Step, StepInputs
from kubelora.engine.step.shape import LoRAShape, Phase, StepShape, decode_buckets, decode_shape, max_tiles
from kubelora.kernels.lora import TILE_HEAD

# Adapters mixed with base rows, one adapter on more rows than a LoRA tile holds.
BATCH = [None, "r4-qv", "r8-all", None, "r16-all-rs", "r32-attn", "r8-all"] + ["r4-qv"] * 17


def test_buckets_cover_every_size_up_to_max():
    buckets = decode_buckets(40)
    assert buckets == [1, 2, 4, 8, 16, 32, 40]
    assert decode_buckets(1) == [1]
    assert decode_buckets(16) == [1, 2, 4, 8, 16]


def _step(num: int, slots: list[int], ranks: list[int]) -> Step:
    tables = {"qkv": ([[10 * s, 0, 10 * s] for s in range(len(ranks))], [[r, 0, r] for r in ranks],
                      [[0.5, 0.0, 0.5] for _ in ranks])}
    return Step(token_ids=np.arange(100, 100 + num), query_lens=[1] * num, start_pos=[3 + i % 2 for i in range(num)],
                block_tables=[(i, 7) for i in range(num)], seq_slots=slots, slot_tables=tables,
                logits_rows=list(range(num)))


def _shape(step: Step, bucket: int) -> StepShape:
    return decode_shape(bucket, step.seq_slots, step.slot_tables)


def test_fill_pads_rows_and_tiles():
    inputs = StepInputs(max_tokens=24, max_seqs=24, max_blocks=4, block_size=4, pad_block=9, kind_slices={"qkv": 3},
                        device=torch.device("cpu"))
    slots = [0] * 18 + [-1, 1]  # slot 0 needs two tiles
    step = _step(20, slots, ranks=[4, 20])
    shape = _shape(step, 24)
    assert shape.lora.kinds == ("qkv",) and shape.lora.lanes == 32 and shape.lora.rows == 16
    extent = inputs.static_extent(shape)
    inputs.fill(step, extent)
    ctx = inputs.context(extent, None)
    assert inputs.token_ids(extent)[20:].tolist() == [0] * 4
    meta = ctx.attention
    assert meta.max_query_len == 1 and inputs.logits_rows(extent) is None  # the decode kernel; every row's logits
    assert meta.slot_mapping[:2].tolist() == [0 * 4 + 3, 7 * 4 + 0]  # position 3: first block; 4: second
    assert meta.slot_mapping[20:].tolist() == [36] * 4  # the pad block's first slot
    assert meta.context_lens[:2].tolist() == [4, 5] and meta.context_lens[20:].tolist() == [1] * 4
    assert meta.query_start_loc.tolist() == list(range(25)) and meta.seq_lens.tolist() == [1] * 24
    assert meta.block_tables[21].tolist() == [9] * 4 and meta.block_tables[1].tolist() == [1, 7, 9, 9]
    lora = ctx.lora.step
    assert lora.tiles.shape == (max_tiles(24, 24), TILE_HEAD + 16)
    tiles = lora.tiles.tolist()
    assert tiles[0][:3] == [0, 0, 16] and tiles[1][:3] == [0, 16, 2] and tiles[2][:3] == [1, 18, 1]
    assert tiles[2][TILE_HEAD] == 19
    assert all(t[0] == 24 and t[2] == 0 for t in tiles[3:])  # empty tiles on the rank-0 pad slot
    proj = ctx.lora.proj["qkv"]
    assert proj.rank[:2].tolist() == [[4, 0, 4], [20, 0, 20]] and not proj.rank[2:].any()
    assert proj.scale[1].tolist() == [0.5, 0.0, 0.5]
    assert proj.max_rank == (32, 32, 32)


def test_eager_extent_is_the_step_itself():
    """A step no static shape holds is read at its own sizes: its tiles as kernels/lora.py plans them, its lanes
    each slice's highest rank, its slot tables as many rows as its adapters."""
    inputs = StepInputs(max_tokens=64, max_seqs=8, max_blocks=4, block_size=4, pad_block=9, kind_slices={"qkv": 3},
                        device=torch.device("cpu"))
    tables = {"qkv": ([[0, 0, 0], [8, 8, 8]], [[8, 0, 8], [4, 4, 4]], [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]])}
    step = Step(token_ids=np.arange(1, 12), query_lens=[6, 1, 4], start_pos=[0, 9, 2],
                block_tables=[(3, 4), (5, 6, 1), (2, 7)], seq_slots=[1, -1, 0], slot_tables=tables,
                logits_rows=[5, 6, 10])
    extent = inputs.eager_extent(step)
    assert (extent.tokens, extent.seqs, extent.max_query_len, extent.logits) == (11, 3, 6, 3)
    inputs.fill(step, extent)
    ctx = inputs.context(extent, None)
    meta = ctx.attention
    assert ctx.positions.tolist() == [0, 1, 2, 3, 4, 5, 9, 2, 3, 4, 5]
    assert meta.slot_mapping.tolist() == [12, 13, 14, 15, 16, 17, 5, 10, 11, 28, 29]
    assert meta.query_start_loc.tolist() == [0, 6, 7, 11] and meta.context_lens.tolist() == [6, 10, 6]
    assert inputs.logits_rows(extent).tolist() == [5, 6, 10]
    lora = ctx.lora
    assert lora.step.token_slots.tolist() == [1] * 6 + [-1] + [0] * 4 and lora.step.num_slots == 2
    assert lora.step.is_slot_tiles and lora.step.tiles[:, :3].tolist() == [[0, 0, 4], [1, 4, 6]]
    assert lora.proj["qkv"].max_rank == (8, 4, 8) and lora.proj["qkv"].rank.tolist() == [[8, 0, 8], [4, 4, 4]]


def test_no_adapter_means_the_base_graph():
    assert _shape(_step(3, [-1, -1, -1], ranks=[8]), 4) == StepShape(Phase.DECODE, 4, None)
    assert _shape(_step(2, [0, 0], ranks=[0]), 2).lora is None  # the adapter adapts no projection kind of the table


def spy_phases(monkeypatch) -> list:
    """Each step's static phase (None: run at its own sizes), as StepExecutor.run takes it."""
    phases = []
    run = StepExecutor.run

    def spy(self, step, pending=None, is_eager=False):
        shape = None if is_eager else self.shape(step)
        phases.append(None if shape is None else shape.phase)
        return run(self, step, pending, is_eager)

    monkeypatch.setattr(StepExecutor, "run", spy)
    return phases


def _generate(llama, is_static: bool, **options):
    llm = LLM(llama.model_dir, max_loras=4, max_lora_rank=32, max_cpu_loras=8, max_num_seqs=32, **options)
    for name, path in llama.adapters.items():
        llm.load_adapter(name, path)
    try:
        assert llm.engine._runner.steps.is_static == is_static
        prompts = [[1] + [(13 + 7 * i + 5 * j) % 480 + 10 for j in range(3 + i % 5)] for i in range(len(BATCH))]
        return llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True), adapters=BATCH)
    finally:
        llm.close()


def test_static_decode_matches_eager_engine(llama, monkeypatch):
    """The CPU engine's default path is the static one (the layouts CUDA replays, run eagerly): every decode step
    of the batch takes it, with the tokens of enforce_eager's per-step tensors."""
    eager = _generate(llama, is_static=False, enforce_eager=True)
    phases = spy_phases(monkeypatch)
    static = _generate(llama, is_static=True)
    assert phases.count(Phase.DECODE) >= 19  # 20 tokens: the first from the prefill, the rest from decode steps
    for name, a, b in zip(BATCH, eager, static):
        assert a.token_ids == b.token_ids, name


def test_warm_up_writes_only_the_pad_block(llama):
    from kubelora.engine.warmup import warm_up, warm_up_adapter_shape, warm_up_sizes

    assert warm_up_sizes(2048) == [16, 32, 64, 100, 128, 256, 512, 1024, 2048]
    assert warm_up_sizes(100) == [16, 32, 64, 100] and warm_up_sizes(40) == [16, 32, 40]
    llm = LLM(llama.model_dir, max_loras=2, max_lora_rank=8, max_num_seqs=4)
    try:
        engine = llm.engine
        cache = engine._runner.model.kv_cache
        pad = engine.num_kv_blocks
        before = [k[:pad].clone() for k in cache.key]
        batches = []
        step_of = engine._runner.step_of
        engine._runner.step_of = lambda batch, rows: batches.append(batch) or step_of(batch, rows)
        assert warm_up(engine._runner, [16, 40], pad, 8) > 0
        del engine._runner.step_of
        # a base and a LoRA step a size, and at the largest one a step whose second half has no adapter
        assert [[(c.slot, len(c.token_ids)) for c in b.chunks] for b in batches] == [
            [(-1, 16)], [(0, 16)], [(-1, 40)], [(0, 40)], [(0, 20), (-1, 20)]]
        assert all(torch.equal(b, k[:pad]) for b, k in zip(before, cache.key))
        assert any(k[pad].abs().sum() > 0 for k in cache.key)
        # A registered adapter's own ranks (the idle engine thread's warm-up on CUDA): again only the pad block.
        assert warm_up_adapter_shape(engine._runner, [16, 40], pad, {"q_proj": 4, "v_proj": 8}) > 0
        assert all(torch.equal(b, k[:pad]) for b, k in zip(before, cache.key))
        assert engine.pending_warm_ups() == []  # CPU: nothing to compile ahead
    finally:
        llm.close()


def test_warm_up_steps_longer_than_max_model_len_fit_the_step_inputs(llama):
    """The start-up warm-up runs one sequence of up to the step budget, which can pass max_model_len: the step
    inputs' block tables hold it (on CUDA every engine whose max_model_len is under its step budget ran it)."""
    from kubelora.engine.warmup import warm_up, warm_up_sizes

    llm = LLM(llama.model_dir, max_loras=2, max_lora_rank=8, max_num_seqs=4, max_model_len=32,
              max_num_batched_tokens=128)
    try:
        engine = llm.engine
        assert warm_up(engine._runner, warm_up_sizes(128), engine.num_kv_blocks, 8) > 0
    finally:
        llm.close()


def test_pool_budget_defaults(llama):
    from kubelora.engine.adapters.pool import DeviceLoRAPool
    from kubelora.engine.config import DEFAULT_CPU_LORAS, EngineConfig
    from kubelora.engine.model.config import load_hf_config, model_config_from_hf

    model = model_config_from_hf(load_hf_config(llama.model_dir), llama.model_dir)
    per_rank = DeviceLoRAPool.bytes_per_rank(model, torch.float32)
    cpu = torch.device("cpu")
    rows = setup.pool_rows(EngineConfig(model_dir="m", max_lora_rank=16), model, torch.float32, cpu)
    assert rows == DEFAULT_CPU_LORAS * 16
    assert setup.pool_rows(EngineConfig(model_dir="m", max_loras=3, max_lora_rank=8), model, torch.float32, cpu) == 24
    config = EngineConfig(model_dir="m", max_loras=3, max_lora_pool_bytes=10 * per_rank)
    assert setup.pool_rows(config, model, torch.float32, cpu) == 10


def test_idle_capture_covers_the_registered_adapter_shapes(llama, cpu_graphs):
    """The idle engine lists the graphs steps over its adapters' two most common shapes need, captures them
    between steps over padding rows (the KV cache outside the pad block stays as it was), then lists none."""
    llm = LLM(llama.model_dir, max_loras=4, max_lora_rank=32, max_cpu_loras=8, max_num_seqs=16)
    try:
        engine = llm.engine
        assert engine.pending_graphs() == []
        for name in ("r4-qv", "r8-all", "r16-all-rs"):  # r8-all and r16-all-rs: one shape (every kind, 16 lanes)
            llm.load_adapter(name, llama.adapters[name])
        pending = engine.pending_graphs()
        shapes = {(shape.lora.kinds, shape.lora.lanes) for shape in pending}
        assert shapes == {(("qkv", "o", "gate_up", "down"), 16), (("qkv",), 16)}
        static = engine._runner.steps
        assert {shape.bucket for shape in pending if shape.phase is Phase.DECODE} == set(static.buckets(Phase.DECODE))
        assert {shape.lora.rows for shape in pending if shape.bucket == 16 and shape.phase is Phase.DECODE} == {
            1, 2, 16}
        cache = engine._runner.model.kv_cache
        pad = engine.num_kv_blocks
        before = [k[:pad].clone() for k in cache.key]
        rounds = 0
        while engine.capture_pending_graphs(budget_s=0.0):  # one graph a call
            rounds += 1
        assert rounds == len(pending) - 1 and engine.pending_graphs() == []
        assert all(torch.equal(b, k[:pad]) for b, k in zip(before, cache.key))
    finally:
        llm.close()


def test_graphs_captured_ahead_stay_beside_the_lru(llama, monkeypatch, cpu_graphs):
    """Graphs captured for the adapters' shapes are not evicted by graphs captured on first use."""
    from kubelora.engine.step import graphs

    monkeypatch.setattr(graphs, "MAX_LORA_GRAPHS", 2)
    llm = LLM(llama.model_dir, max_loras=4, max_lora_rank=32, max_cpu_loras=8, max_num_seqs=4)
    try:
        llm.load_adapter("r4-qv", llama.adapters["r4-qv"])
        llm.capture_graphs()
        cache = llm.engine._runner.steps.graphs
        ahead = set(cache.pinned)
        assert ahead and not llm.engine.pending_graphs()

        def shape(lanes: int) -> StepShape:
            return StepShape(Phase.DECODE, 1, LoRAShape(("o",), lanes, 1))

        for lanes in (32, 48, 64):  # three more shapes, on first use: the LRU keeps two of them
            cache.capture(shape(lanes), lambda: torch.zeros(1, 4))
        assert all(graph in cache for graph in ahead) and not llm.engine.pending_graphs()
        assert shape(32) not in cache and shape(64) in cache
    finally:
        llm.close()


def test_warm_up_requests_leave_the_engine_as_new(llama, prompt_ids):
    """The step-loop warm-up (CUDA start-up) finishes its requests, frees their blocks and changes no output."""
    from kubelora.engine.warmup import WARM_UP_REQUESTS, warm_up_requests

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm = LLM(llama.model_dir, max_loras=2, max_lora_rank=8, max_num_seqs=4)
    try:
        engine = llm.engine
        before = [o.token_ids for o in llm.generate([prompt_ids(0, 12), prompt_ids(1, 30)], params)]
        free = engine._blocks.num_free
        assert warm_up_requests(engine) > 0
        assert not engine.has_unfinished() and engine._blocks.num_free == free
        assert engine._scheduler.get(f"kubelora-warm-up-{len(WARM_UP_REQUESTS[-1])}-0") is None
        assert [o.token_ids for o in llm.generate([prompt_ids(0, 12), prompt_ids(1, 30)], params)] == before
    finally:
        llm.close()
    small = LLM(llama.model_dir, max_model_len=8, max_waiting=1, max_num_seqs=1)  # a short prompt, one at a time
    try:
        assert warm_up_requests(small.engine) > 0 and not small.engine.has_unfinished()
    finally:
        small.close()


def test_the_matmul_library_is_cublaslt_unless_the_entry_point_names_another():
    from kubelora.engine.config import EngineConfig
    from kubelora.engine.server.config import engine_switches_from_env

    assert EngineConfig(model_dir="m").blas_library == "cublaslt"
    assert engine_switches_from_env({"KUBELORA_BLAS": " cuBLAS "}) == {"blas_library": "cublas"}
    assert engine_switches_from_env({"KUBELORA_GEMV": "0", "KUBELORA_PREFILL_GRAPHS": "1"}) == {
        "use_gemv": False, "use_prefill_graphs": True}
    assert setup.configure_blas(torch.device("cpu"), "cublas") is None  # a CUDA setting only
    with pytest.raises(ValueError, match="cublaslt, cublas"):
        EngineConfig(model_dir="m", blas_library="rocblas")
