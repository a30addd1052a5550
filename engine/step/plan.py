"""Which graphs and kernel variants the registered adapters will need, decided from their shapes (pure functions).

The idle engine thread captures what `plan_graphs` lists and runs the prefill sizes for what `plan_warm_ups` lists
(engine/engine.py: capture_pending_graphs) before the adapters' first requests need them; `/ready` waits for both.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from kubelora.engine.adapters.pool import table_modules
from kubelora.engine.adapters.types import AdapterInfo
from kubelora.engine.model.config import PROJ_KINDS, ModelConfig
from kubelora.engine.step.shape import Phase, StepShape, plan_decode_shapes, plan_prefill_shapes, rank_lanes
from kubelora.engine.step.executor import StepExecutor

MAX_GRAPH_SHAPES = 2  # adapter shapes whose LoRA decode and prefill graphs are captured before their first step
MAX_WARM_SHAPES = 8  # adapters' module ranks whose prefill kernels are run ahead of their first request (CUDA)

Ranks = tuple[tuple[str, int], ...]  # (module, rank) of the modules an adapter adapts, sorted


class AdapterShape(NamedTuple):
    kinds: tuple[str, ...]  # table kinds adapted (projection kinds, then embed, lm_head)
    lanes: int  # max rank rounded up to RANK_LANE
    staged_rows: tuple[tuple[str, int], ...]  # (kind, its ranks summed over the kind's modules) per kind adapted
    dora: tuple[str, ...] = ()  # projection kinds a DoRA adapter adapts


def _most_common(items: Iterable, limit: int) -> tuple[list, dict]:
    """(the `limit` most frequent items, most frequent first, ties in first-seen order; every item's count)."""
    counts: dict = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return sorted(counts, key=lambda item: -counts[item])[:limit], counts


def plan_warm_ups(infos: list[AdapterInfo], warmed: set[Ranks]) -> list[Ranks]:
    """The most common MAX_WARM_SHAPES module-rank sets of the adapters whose eager LoRA kernels have not run."""
    common, _ = _most_common((tuple(sorted((m, r) for m, r in info.ranks.items() if r > 0)) for info in infos),
                             MAX_WARM_SHAPES)
    return [ranks for ranks in common if ranks and ranks not in warmed]


def adapter_shape(info: AdapterInfo, model: ModelConfig) -> AdapterShape | None:
    """What an adapter's graphs are specialised on: the projection kinds it adapts, its max rank rounded up to 16,
    and per kind the rows its A takes when staged (its ranks over the kind's modules, as engine/adapters/staging.py
    stages them)."""
    rows = tuple((k, sum(info.ranks.get(m, 0) for m in modules)) for k, modules in table_modules(model).items())
    kinds = tuple(k for k, n in rows if n > 0)
    dora = tuple(k for k in kinds if k in PROJ_KINDS) if info.use_dora else ()
    return AdapterShape(kinds, rank_lanes(info.rank), tuple((k, n) for k, n in rows if n > 0), dora) if kinds else None


def plan_graphs(infos: list[AdapterInfo], model: ModelConfig, steps: StepExecutor
                ) -> tuple[list[StepShape], list[StepShape]]:
    """(the graphs not captured yet, every graph wanted) for the MAX_GRAPH_SHAPES most common adapter shapes: each
    shape's decode and prefill step shapes (engine/step/shape.py); none without graphs."""
    if not steps.use_graphs:
        return [], []
    shapes = [shape for shape in (adapter_shape(info, model) for info in infos) if shape is not None]
    common, counts = _most_common(shapes, MAX_GRAPH_SHAPES)
    decode, prefill = steps.buckets(Phase.DECODE), steps.buckets(Phase.PREFILL)
    wanted = [step for shape in common for step in plan_decode_shapes(
        decode, shape.kinds, shape.lanes, counts[shape], steps.staging, dict(shape.staged_rows), shape.dora)]
    wanted += [step for shape in common for step in plan_prefill_shapes(prefill, shape.kinds, shape.lanes, shape.dora)]
    return [step for step in wanted if not steps.has_graph(step)], wanted
