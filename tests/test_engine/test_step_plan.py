"""The graph planner's choices from the registered adapters' shapes (no model, no device)."""

from __future__ import annotations

from kubelora.engine.adapters.types import AdapterInfo
from kubelora.engine.step.plan import MAX_WARM_SHAPES, adapter_shape, plan_graphs, plan_warm_ups
from kubelora.engine.model.config import ModelConfig
from kubelora.engine.step.shape import LoRAShape, Phase, StepShape


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
    assert adapter_shape(_info("a", QV), model) == (("qkv",), 16, (("qkv", 16),), ())
    assert adapter_shape(_info("b", ATTN), model) == (("qkv", "o"), 32, (("qkv", 72), ("o", 24)), ())
    assert adapter_shape(_info("c", {"q_proj": 0}), model) is None


def test_warm_ups_are_the_common_rank_sets_not_yet_run():
    infos = [_info("a", QV), _info("b", ATTN), _info("c", dict(ATTN)), _info("d", {"q_proj": 0})]
    assert plan_warm_ups(infos, set()) == [tuple(sorted(ATTN.items())), tuple(sorted(QV.items()))]
    assert plan_warm_ups(infos, {tuple(sorted(ATTN.items()))}) == [tuple(sorted(QV.items()))]
    many = [_info(f"r{r}", {"q_proj": r}) for r in range(1, MAX_WARM_SHAPES + 3)]
    assert len(plan_warm_ups(many, set())) == MAX_WARM_SHAPES


class _Static:
    """A StepExecutor stand-in: its buckets per phase, some shapes captured."""

    def __init__(self, buckets: dict, captured=(), use_graphs: bool = True) -> None:
        self._buckets, self.captured, self.use_graphs = buckets, set(captured), use_graphs
        self.staging = None

    def buckets(self, phase):
        return self._buckets.get(phase, [])

    def has_graph(self, shape) -> bool:
        return shape in self.captured


def _shape(phase: Phase, bucket: int, kinds: tuple[str, ...], lanes: int, rows: int) -> StepShape:
    return StepShape(phase, bucket, LoRAShape(kinds, lanes, rows))


def test_graphs_of_the_two_common_shapes_decode_then_prefill():
    model: ModelConfig = _Model()  # type: ignore[assignment]
    infos = [_info("a", QV), _info("b", ATTN), _info("c", dict(ATTN)), _info("d", {"o_proj": 64})]
    attn, qv = ("qkv", "o"), ("qkv",)
    captured = {_shape(Phase.DECODE, 1, attn, 32, 1), _shape(Phase.PREFILL, 32, qv, 16, 16)}
    static = _Static({Phase.DECODE: [1, 2], Phase.PREFILL: [16, 32]}, captured)
    pending, wanted = plan_graphs(infos, model, static)
    assert wanted == [_shape(Phase.DECODE, 1, attn, 32, 1), _shape(Phase.DECODE, 2, attn, 32, 1),
                      _shape(Phase.DECODE, 2, attn, 32, 2), _shape(Phase.DECODE, 1, qv, 16, 1),
                      _shape(Phase.DECODE, 2, qv, 16, 1), _shape(Phase.DECODE, 2, qv, 16, 2),
                      _shape(Phase.PREFILL, 16, attn, 32, 16), _shape(Phase.PREFILL, 32, attn, 32, 16),
                      _shape(Phase.PREFILL, 16, qv, 16, 16), _shape(Phase.PREFILL, 32, qv, 16, 16)]
    assert pending == [g for g in wanted if g not in captured]
    no_prefill = _Static({Phase.DECODE: [1, 2]})  # use_prefill_graphs off: decode graphs only
    assert all(shape.phase is Phase.DECODE for shape in plan_graphs(infos, model, no_prefill)[1])
    assert plan_graphs(infos, model, _Static({Phase.DECODE: [1, 2]}, use_graphs=False)) == ([], [])
