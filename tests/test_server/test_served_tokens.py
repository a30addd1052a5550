"""Each adapter's demand, as the operator reads it: `tokens_served` on the admin port's model list (prompt and
generated tokens of finished requests), never on the serving port."""

from __future__ import annotations


async def test_the_admin_list_counts_each_adapters_finished_tokens(start_app, config_for, material):
    client = await start_app(config_for(lora=(("a0", str(material.adapters["a0"])),
                                              ("a1", str(material.adapters["a1"])))))
    usage = {"prompt_tokens": 0, "completion_tokens": 0}
    for _ in range(2):
        answer = await (await client.post("/v1/completions", json={"model": "a0", "prompt": "hello there",
                                                                   "max_tokens": 5})).json()
        for name in usage:
            usage[name] += answer["usage"][name]
    cards = {c["id"]: c for c in (await (await client.admin.get("/v1/models")).json())["data"]}
    assert cards["a0"]["tokens_served"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0
    assert cards["a1"]["tokens_served"] == 0
    public = (await (await client.get("/v1/models")).json())["data"]
    assert not any("tokens_served" in c for c in public)
