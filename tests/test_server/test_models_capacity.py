"""`GET /v1/models` reports what the operator places by: each adapter's device pool bytes at its own
rank (counted per module as the base card's adapter_module_bytes says), and the base card's device adapter pool
budget."""

from __future__ import annotations


async def test_cards_carry_bytes_at_their_own_rank_and_the_pool_budget(start_app, config_for, material):
    api = await start_app(config_for(max_lora_pool_bytes=1 << 20))
    for name in ("a0", "a5"):  # both on q_proj, v_proj; rank 4 and rank 16
        response = await api.admin.post("/v1/load_lora_adapter", json={"lora_name": name,
                                                                 "lora_path": str(material.adapters[name]),
                                                                 "preload": name == "a0"})
        assert response.status == 200
    cards = {c["id"]: c for c in (await (await api.get("/v1/models")).json())["data"]}
    base = next(c for c in cards.values() if c["parent"] is None)
    assert 0 < base["adapter_pool_bytes"] <= 1 << 20  # the budget, rounded down to whole rank rows
    costs = base["adapter_module_bytes"]  # how bytes are counted: per module, per rank row plus alignment
    for name, rank in (("a0", 4), ("a5", 16)):
        assert cards[name]["bytes"] == sum(rank * costs[m]["per_rank"] + costs[m]["fixed"] for m in ("q_proj", "v_proj"))
    assert 0 < cards["a0"]["bytes"] < cards["a5"]["bytes"] < 4 * cards["a0"]["bytes"]
    assert cards["a5"]["residency"] == "known"  # a registration reports its size too
