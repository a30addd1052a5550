"""The graph planner's choices from the registered adapters' shapes (no model, no device)."""

from __future__ import annotations

from kubelora.engine.adapters.types import AdapterInfo
from kubelora.engine.graph_plan import MAX_WARM_SHAPES, adapter_shape, plan_graphs, plan_warm_ups
from kubelora.engine.model.config import ModelConfig


def _info(name: str, ranks: dict[str, int]) -> AdapterInfo:
    return AdapterInfo(name=name, revision="1", path="/a", tier="host", rank=max(ranks.values()), ranks=ranks,
                       targets=tuple(ranks), bytes=0, host_bytes=0, loaded_at=0.0, base_model="m", num_refs=0,
                       is_loading=False, is_unloading=False, last_error=None)


class _Model:
    """The one ModelConfig method the planner reads."""

    def kind_modules(self, kind: str) -> tuple[str, ...]:
        return {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
                "down": ("down_proj",)}[kind]


QV = {"q_proj": 8, "v_proj": 8}
ATTN = {"q_proj": 24, "k_proj": 24, "v_proj": 24, "o_proj": 24}


def test_adapter_shape_is_kinds_and_rank_lanes():
    model: ModelConfig = _Model()  # type: ignore[assignment]
    assert adapter_shape(_info("a", QV), model) == (("qkv",), 16)
    assert adapter_shape(_info("b", ATTN), model) == (("qkv", "o"), 32)
    assert adapter_shape(_info("c", {"q_proj": 0}), model) is None


def test_warm_ups_are_the_common_rank_sets_not_yet_run():
    infos = [_info("a", QV), _info("b", ATTN), _info("c", dict(ATTN)), _info("d", {"q_proj": 0})]
    assert plan_warm_ups(infos, set()) == [tuple(sorted(ATTN.items())), tuple(sorted(QV.items()))]
    assert plan_warm_ups(infos, {tuple(sorted(ATTN.items()))}) == [tuple(sorted(QV.items()))]
    many = [_info(f"r{r}", {"q_proj": r}) for r in range(1, MAX_WARM_SHAPES + 3)]
    assert len(plan_warm_ups(many, set())) == MAX_WARM_SHAPES


class _Graphs:
    """A decoder or prefill stand-in: one graph per bucket, some captured."""

    def __init__(self, captured=(), use_graphs: bool = True) -> None:
        self.captured, self.use_graphs = set(captured), use_graphs

    def lora_graph_keys(self, kinds, lanes, num_adapters):
        return [(bucket, ("decode", kinds, lanes, num_adapters)) for bucket in (1, 2)]

    def graph_keys(self, kinds, lanes):
        return [(bucket, ("prefill", kinds, lanes)) for bucket in (16, 32)]

    def has_graph(self, bucket, key) -> bool:
        return (bucket, key) in self.captured


def test_graphs_of_the_two_common_shapes_decode_then_prefill():
    model: ModelConfig = _Model()  # type: ignore[assignment]
    infos = [_info("a", QV), _info("b", ATTN), _info("c", dict(ATTN)), _info("d", {"o_proj": 64})]
    decoder = _Graphs(captured={(1, ("decode", ("qkv", "o"), 32, 2))})
    prefill = _Graphs(captured={(32, ("prefill", ("qkv",), 16))})
    pending, wanted = plan_graphs(infos, model, decoder, prefill)
    assert wanted == [(1, ("decode", ("qkv", "o"), 32, 2)), (2, ("decode", ("qkv", "o"), 32, 2)),
                      (1, ("decode", ("qkv",), 16, 1)), (2, ("decode", ("qkv",), 16, 1)),
                      (16, ("prefill", ("qkv", "o"), 32)), (32, ("prefill", ("qkv", "o"), 32)),
                      (16, ("prefill", ("qkv",), 16)), (32, ("prefill", ("qkv",), 16))]
    assert pending == [g for g in wanted if g not in decoder.captured | prefill.captured]
    eager_prefill = _Graphs(use_graphs=False)  # prefill graphs off (CPU): decode graphs only
    assert all(key[0] == "decode" for _, key in plan_graphs(infos, model, decoder, eager_prefill)[1])
    assert plan_graphs(infos, model, None, prefill) == ([], [])
