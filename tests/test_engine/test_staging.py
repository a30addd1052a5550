"""Staged shrinks' placement (engine/adapters/staging.py): rows copied from the pool once per adapter placement,
kept across steps, evicted for a step's new adapters, restaged from row 0 when spread out, and no staging at all
for a step past the capacity."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kubelora.engine.adapters.pool import SlotView
from kubelora.engine.adapters.staging import ShrinkStaging
from kubelora.engine.step.shape import stage_bucket

LAYERS, IN_DIM, BASE = 2, 8, 5
MODULES = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",)}


def make(capacity: dict[str, int]):
    gen = torch.Generator().manual_seed(0)
    pool = SimpleNamespace(a={m: torch.randn(LAYERS, 200, IN_DIM, generator=gen) for mods in MODULES.values()
                              for m in mods})
    buffers = {kind: torch.zeros(LAYERS, BASE + cap, IN_DIM) for kind, cap in capacity.items()}
    return ShrinkStaging(buffers, {kind: BASE for kind in capacity}, MODULES, pool), pool


def view(placement: int, first: int, ranks: dict[str, int]) -> SlotView:
    return SlotView(row_start={m: first + 10 * i for i, m in enumerate(ranks)}, rank=dict(ranks),
                    scale={m: 1.0 for m in ranks}, placement=placement)


def check_rows(staging, pool, slots, staged) -> None:
    """Every slot's staged rows hold its pool rows, slice by slice, at t_col."""
    for kind, mods in MODULES.items():
        buf = staging.buffers[kind]
        for v, cols in zip(slots, staged.t_col[kind]):
            for m, col in zip(mods, cols):
                rank = v.rank.get(m, 0)
                if rank:
                    want = pool.a[m][:, v.row_start[m] : v.row_start[m] + rank]
                    assert torch.equal(buf[:, BASE + col : BASE + col + rank], want), (kind, m)


def test_bucket_steps_by_at_most_half():
    sizes = [stage_bucket(r, 10_000) for r in range(1, 5000)]
    assert sizes[:64] == [64] * 64 and stage_bucket(65, 10_000) == 96 and stage_bucket(97, 10_000) == 128
    assert stage_bucket(1536, 10_000) == 1536 and stage_bucket(3072, 10_000) == 3072
    assert all(r <= s <= max(64, 1.5 * r) for r, s in zip(range(1, 5000), sizes))
    assert stage_bucket(0, 100) == 0 and stage_bucket(90, 80) == 80


def test_rows_copied_once_and_kept_across_steps():
    staging, pool = make({"qkv": 96, "o": 32})
    a = view(1, 0, {"q_proj": 4, "v_proj": 4, "o_proj": 4})
    b = view(2, 50, {"q_proj": 8, "k_proj": 8, "v_proj": 8})
    staged = staging.stage((a, b))
    assert staged.t_col["qkv"] == [[0, 0, 4], [8, 16, 24]] and staged.t_col["o"] == [[0], [0]]
    assert staged.rows == {"qkv": 64, "o": 32}  # 32 rows in the smallest bucket; o's capped at its capacity
    check_rows(staging, pool, (a, b), staged)
    copies = staging.num_copies
    again = staging.stage((b, a))  # the next step, slots in another order: nothing copied
    assert staging.num_copies == copies
    assert again.t_col["qkv"] == [[8, 16, 24], [0, 0, 4]]
    check_rows(staging, pool, (b, a), again)


def test_new_adapters_evict_unused_ones_and_spread_rows_restage():
    staging, pool = make({"qkv": 200, "o": 64})
    first = [view(i, 3 * i, {"q_proj": 16, "k_proj": 16, "v_proj": 16, "o_proj": 16}) for i in range(4)]
    staging.stage(tuple(first))  # qkv rows 0..192
    c = view(9, 100, {"q_proj": 16, "k_proj": 16, "v_proj": 16, "o_proj": 16})
    staged = staging.stage((first[3], c))  # c needs room: the three others go
    check_rows(staging, pool, (first[3], c), staged)
    assert staged.rows["qkv"] <= stage_bucket(96, 200)  # rows of first[3] were at 144: restaged from 0
    assert sorted(col[0] for col in staged.t_col["qkv"]) == [0, 48]


def test_a_step_past_the_capacity_is_not_staged():
    staging, _ = make({"qkv": 40, "o": 64})
    big = view(1, 0, {"q_proj": 16, "k_proj": 16, "v_proj": 16})
    assert staging.stage((big,)) is None and staging.num_copies == 0
    small = view(2, 0, {"q_proj": 8, "o_proj": 8})
    assert staging.stage((small,)).rows == {"qkv": 40, "o": 64}


def test_a_new_placement_of_the_same_rows_is_copied_again():
    staging, pool = make({"qkv": 96, "o": 32})
    a = view(1, 0, {"q_proj": 4})
    staging.stage((a,))
    pool.a["q_proj"][:, 0:4] += 1  # the pool reloaded an adapter into the same rows (a new placement id)
    reloaded = view(2, 0, {"q_proj": 4})
    staged = staging.stage((reloaded,))
    check_rows(staging, pool, (reloaded,), staged)


def test_graphs_captured_ahead_carry_the_staged_rows_of_their_steps():
    from kubelora.engine.step.shape import decode_buckets, plan_decode_shapes

    staging, _ = make({"qkv": 3072, "o": 1024})
    buckets = decode_buckets(64)
    keys = {(s.bucket, s.lora.rows): s.lora.stage for s in plan_decode_shapes(buckets, ("qkv", "o"), 16, 32, staging)}
    assert keys[(64, 2)] == (("qkv", 1536), ("o", 512))  # 64 sequences over the 32 adapters
    assert keys[(64, 1)] == (("qkv", 1536), ("o", 512))  # at most the 32 registered
    assert keys[(1, 1)] == (("qkv", 64), ("o", 64))
    big = {(s.bucket, s.lora.rows): s.lora.stage for s in plan_decode_shapes(buckets, ("qkv",), 64, 64, staging)}
    assert big[(64, 1)] == () and big[(16, 16)] == (("qkv", 192),)  # past the capacity: the shrink launches


def test_staging_capacity_follows_what_one_step_can_hold():
    """Rows per module: at most ROWS_PER_SLICE, max_num_seqs x max_lora_rank, and a fixed pool's rows."""
    from kubelora.engine import setup
    from kubelora.engine.adapters.pool import DeviceLoRAPool
    from kubelora.engine.adapters.staging import ROWS_PER_SLICE
    from kubelora.engine.config import EngineConfig
    from kubelora.engine.model.config import ModelConfig

    model = ModelConfig(model_type="llama", name="m", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                        head_dim=16, intermediate_size=128, vocab_size=64, max_position_embeddings=256,
                        rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False,
                        sliding_windows=(None, None), eos_token_ids=(0,))
    per_rank = DeviceLoRAPool.bytes_per_rank(model, torch.bfloat16)

    def rows(**options) -> dict[str, int]:
        return setup.staged_rows(EngineConfig(model_dir="/m", **options), model, torch.bfloat16)

    assert rows(max_num_seqs=256) == {"qkv": 3 * ROWS_PER_SLICE, "o": ROWS_PER_SLICE}  # the pool follows free memory
    assert rows(max_num_seqs=4, max_lora_rank=16) == {"qkv": 3 * 64, "o": 64}
    assert rows(max_num_seqs=256, max_loras=8, max_lora_rank=16) == {"qkv": 3 * 128, "o": 128}
    assert rows(max_num_seqs=256, max_lora_pool_bytes=40 * per_rank + 5) == {"qkv": 3 * 40, "o": 40}
