"""Step shapes (engine/step/shape.py): the graphs planned ahead for an adapter shape are the shapes its steps key
to, because both are built by the same rounding."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kubelora.engine.step.shape import (TILE_M, Phase, StepShape, bucket_for, decode_buckets, decode_shape,
                                        plan_decode_shapes, plan_prefill_shapes, prefill_buckets, prefill_shape,
                                        rank_lanes, stage_bucket, tile_rows)


def _tables(num_slots: int, rank: int) -> dict:
    """Every slot adapting q, k and v at `rank`, o not at all."""
    return {"qkv": ([[0, 0, 0]] * num_slots, [[rank] * 3] * num_slots, [[1.0] * 3] * num_slots),
            "o": ([[0]] * num_slots, [[0]] * num_slots, [[0.0]] * num_slots)}


def test_rounding():
    assert [rank_lanes(r) for r in (1, 16, 17, 33)] == [16, 16, 32, 48]
    assert [tile_rows(n) for n in (1, 2, 3, 5, 16, 40)] == [1, 2, 4, 8, 16, 16]
    assert bucket_for([1, 2, 4], 3) == 4 and bucket_for([1, 2, 4], 5) is None
    assert decode_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert all(b % TILE_M == 0 for b in prefill_buckets(2048))
    assert stage_bucket(65, 10_000) == 96


@pytest.mark.parametrize("rank", [3, 16, 20])
@pytest.mark.parametrize("num_adapters", [1, 3, 40])
def test_planned_decode_shapes_are_the_shapes_of_full_steps(rank, num_adapters):
    """A bucket of steps spreading its rows over adapters of one shape, one, two or a tile's tokens each, keys
    to a shape planned ahead, staged rows included: staging takes each adapter's own ranks (not its rank lanes),
    so ranks that are no multiple of 16 plan the rows their steps stage."""
    modules = {"qkv": ("q_proj", "k_proj", "v_proj")}
    staging = SimpleNamespace(modules=modules, capacity={"qkv": 3 * 1024})
    buckets = decode_buckets(64)
    planned = set(plan_decode_shapes(buckets, ("qkv",), rank, num_adapters, staging, {"qkv": 3 * rank}))
    for bucket in buckets:
        for tokens in {1, min(2, tile_rows(bucket)), tile_rows(bucket)}:
            adapters = min(-(-bucket // tokens), num_adapters)
            slots = [i % adapters for i in range(bucket)] if adapters * tokens >= bucket else [
                i // tokens for i in range(bucket)]
            rows = adapters * rank * 3  # past the capacity the step is not staged (ShrinkStaging.stage)
            staged = {"qkv": stage_bucket(rows, 3 * 1024)} if rows <= 3 * 1024 else None
            shape = decode_shape(bucket, slots, _tables(adapters, rank), staged)
            if max(slots.count(s) for s in set(slots)) == tokens:
                assert shape in planned, (bucket, tokens)


def test_planned_prefill_shapes_are_the_shapes_of_chunks():
    buckets = prefill_buckets(256)
    planned = plan_prefill_shapes(buckets, ("qkv",), 20)
    assert planned == [prefill_shape(b, _tables(1, 20)) for b in buckets]
    assert prefill_shape(16, None) == StepShape(Phase.PREFILL, 16, None)
