"""Static steps: a step filled into the static layout of its phase, then the graph of its shape replayed, or the
same inputs run eagerly where no graph is captured (off CUDA, `--enforce-eager` aside: tests run this path).

Two layouts (engine/step/layout.py) hold a static step's inputs at fixed addresses: `DecodeInputs` (one token
per sequence, padded to a batch bucket) and `PrefillInputs` (one sequence's chunk, padded to a token bucket).
Each step is a `DecodeStep` or a `PrefillStep`; its `StepShape` (engine/step/shape.py) names its graph in the one
`GraphCache` (engine/step/graphs.py). A decode step whose LoRA shape has no graph yet captures it on first use
(tens to hundreds of milliseconds at 7B, once per shape); a prefill chunk whose graph is missing is not
static (`is_ready`) and runs on the eager path instead: its adapter graphs are captured only while the engine is
idle, never on a request's path.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from kubelora.engine.adapters.staging import ShrinkStaging
from kubelora.engine.model.llama import DecoderModel, ForwardContext
from kubelora.engine.step.decode import DecodeInputs, DecodeStep
from kubelora.engine.step.graphs import GraphCache
from kubelora.engine.step.prefill import PrefillInputs, PrefillStep
from kubelora.engine.step.shape import Phase, StepShape, bucket_for
from kubelora.kernels.lora import LoRAOps, lora_ops

log = logging.getLogger(__name__)

Pending = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (rows, sources, tokens): see StaticSteps.run


class StaticLayout(Protocol):
    """What DecodeInputs and PrefillInputs share: the executor fills, reads and captures through this only."""

    phase: Phase
    buckets: list[int]
    is_captured_on_first_use: bool
    device: torch.device

    def fill(self, step, shape: StepShape) -> None: ...
    def fill_padding(self) -> None: ...
    def token_ids(self, bucket: int) -> torch.Tensor: ...
    def context(self, shape: StepShape, lora_ops: LoRAOps) -> ForwardContext: ...
    def logits_rows(self) -> torch.Tensor | None: ...


class StaticSteps:
    def __init__(self, model: DecoderModel, layouts: list[StaticLayout], lora_backend: str, use_graphs: bool,
                 staging: ShrinkStaging | None = None) -> None:
        self.model = model
        self.layouts = {layout.phase: layout for layout in layouts}
        self.lora_ops = lora_ops(lora_backend)
        self.use_graphs = use_graphs
        self.staging = staging  # decode steps' staged shrinks (engine/adapters/staging.py); None: off
        self.graphs = GraphCache(layouts[0].device)

    def buckets(self, phase: Phase) -> list[int]:
        layout = self.layouts.get(phase)
        return layout.buckets if layout is not None else []

    def bucket_for(self, phase: Phase, size: int) -> int | None:
        return bucket_for(self.buckets(phase), size)

    def is_ready(self, shape: StepShape) -> bool:
        """Whether a step of this shape runs here: its graph is captured, or captured on first use, or graphs
        are off (the same inputs run eagerly)."""
        return (not self.use_graphs or self.layouts[shape.phase].is_captured_on_first_use
                or shape in self.graphs)

    def has_graph(self, shape: StepShape) -> bool:
        return shape in self.graphs

    def run(self, step: DecodeStep | PrefillStep, shape: StepShape, pending: Pending | None = None) -> torch.Tensor:
        """The step's logits [step.num_logits, vocab] float32: a view of its graph's static output, or of an eager
        forward's over the same inputs.

        pending: device tensors: token_ids[rows] = tokens[sources] before the replay, for tokens the previous
        step sampled and the host has not read back."""
        layout = self.layouts[shape.phase]
        layout.fill(step, shape)
        if pending is not None:
            rows, sources, tokens = pending
            layout.token_ids(shape.bucket)[rows] = tokens[sources]
        graph = self.graphs.get(shape)
        if graph is None and self.use_graphs and layout.is_captured_on_first_use:
            graph = self.graphs.capture(shape, lambda: self._forward(shape))
        if graph is None:
            return self._forward(shape)[: step.num_logits]
        graph.graph.replay()
        return graph.logits[: step.num_logits]

    def capture_base(self) -> None:
        """The base-model graph of every bucket of every layout, largest first (the pool then serves the smaller
        ones), over padding: the warm-up forward writes only the pad block."""
        for phase, layout in self.layouts.items():
            layout.fill_padding()
            for bucket in sorted(layout.buckets, reverse=True):
                shape = StepShape(phase, bucket, None)
                self.graphs.capture(shape, lambda shape=shape: self._forward(shape))

    def capture_idle(self, shape: StepShape) -> None:
        """Capture a planned shape's graph between steps (nothing in flight), over padding: it writes only the pad
        block. It stays while the shape is planned (`GraphCache.keep`)."""
        self.layouts[shape.phase].fill_padding()
        self.graphs.capture(shape, lambda: self._forward(shape), is_planned=True)

    def _forward(self, shape: StepShape) -> torch.Tensor:
        layout = self.layouts[shape.phase]
        hidden = self.model.forward(layout.token_ids(shape.bucket), layout.context(shape, self.lora_ops))
        rows = layout.logits_rows()
        return self.model.compute_logits(hidden if rows is None else hidden.index_select(0, rows))
