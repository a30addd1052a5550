"""The step executor: every forward pass filled into step inputs, then a captured graph replayed or the same inputs
run eagerly.

Two `StepInputs` (engine/step/inputs.py) hold every step's inputs: `decode` for decode steps (one token per
sequence, padded to a batch bucket), `general` for the rest (a lone sequence's chunk padded to a token bucket,
and any other step at its own sizes). A step with a `StepShape` (engine/step/shape.py) is static: it names its
graph in the one `GraphCache` (engine/step/graphs.py). A decode step whose LoRA shape has no graph yet captures it
on first use (tens to hundreds of milliseconds at 7B, once per shape); a prefill chunk whose graph is missing runs
eagerly at its own sizes instead: its adapter graphs are captured only while the engine is idle, never on a
request's path. Without graphs (off CUDA, or `enforce_eager`) static steps run the same padded inputs eagerly, so
the CPU suite runs what CUDA replays; with `is_static` off every step runs at its own sizes.
"""

from __future__ import annotations

import logging

import torch

from kubelora.engine.adapters.staging import ShrinkStaging
from kubelora.engine.model.llama import DecoderModel
from kubelora.engine.step.graphs import GraphCache
from kubelora.engine.step.inputs import Extent, Step, StepInputs
from kubelora.engine.step.shape import (Phase, StepShape, bucket_for, decode_buckets, decode_shape, prefill_buckets,
                                        prefill_shape)
from kubelora.kernels.lora import lora_ops

log = logging.getLogger(__name__)

Pending = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (rows, sources, tokens): see StepExecutor.run


class StepExecutor:
    def __init__(self, model: DecoderModel, decode: StepInputs, general: StepInputs, lora_backend: str, *,
                 use_graphs: bool, is_static: bool = True, prefill_max_tokens: int = 0,
                 staging: ShrinkStaging | None = None) -> None:
        """prefill_max_tokens: a lone sequence's chunks up to this many tokens are static (0: none are)."""
        self.model = model
        self.inputs = {Phase.DECODE: decode, Phase.PREFILL: general}
        self.general = general
        self.lora_ops = lora_ops(lora_backend)
        self.use_graphs = use_graphs
        self.is_static = is_static
        self.staging = staging  # decode steps' staged shrinks (engine/adapters/staging.py); None: off
        self._buckets = {Phase.DECODE: decode_buckets(decode.max_seqs) if is_static else [],
                         Phase.PREFILL: prefill_buckets(prefill_max_tokens) if is_static and prefill_max_tokens else []}
        self.graphs = GraphCache(decode.device)

    def buckets(self, phase: Phase) -> list[int]:
        return self._buckets[phase]

    def bucket_for(self, phase: Phase, size: int) -> int | None:
        return bucket_for(self._buckets[phase], size)

    def has_graph(self, shape: StepShape) -> bool:
        return shape in self.graphs

    def shape(self, step: Step) -> StepShape | None:
        """The static shape of a step that one holds and whose graph runs now; None: the step runs eagerly."""
        if step.is_decode:
            bucket = self.bucket_for(Phase.DECODE, step.num_seqs)
            if bucket is None:
                return None
            return decode_shape(bucket, step.seq_slots, step.slot_tables,
                                step.staged.rows if step.staged is not None else None)
        if step.num_seqs != 1 or step.num_tokens < 2 or step.logits_rows not in ([], [step.num_tokens - 1]):
            return None
        bucket = self.bucket_for(Phase.PREFILL, step.num_tokens)
        if bucket is None:
            return None
        shape = prefill_shape(bucket, step.slot_tables if step.seq_slots[0] >= 0 else None)
        # a chunk's adapter graphs are captured while the engine is idle, never on a request's path
        return shape if not self.use_graphs or shape in self.graphs else None

    def run(self, step: Step, pending: Pending | None = None, is_eager: bool = False) -> torch.Tensor:
        """The step's logits [step.num_logits, vocab] float32: a view of its graph's static output, or of an eager
        forward's over the same inputs.

        pending: device tensors: token_ids[rows] = tokens[sources] before the forward, for tokens the previous
        step sampled and the host has not read back. is_eager: at the step's own sizes (the start-up warm-up's
        kernel compiles)."""
        shape = None if is_eager else self.shape(step)
        if shape is None:
            inputs, extent = self.general, self.general.eager_extent(step)
        else:
            inputs = self.inputs[shape.phase]
            extent = inputs.static_extent(shape)
        inputs.fill(step, extent)
        if pending is not None:
            rows, sources, tokens = pending
            inputs.token_ids(extent)[rows] = tokens[sources]
        graph = self.graphs.get(shape) if shape is not None and self.use_graphs else None
        if graph is None and shape is not None and self.use_graphs:  # a decode step's new LoRA shape
            graph = self.graphs.capture(shape, lambda: self._forward(inputs, extent))
        if graph is None:
            return self._forward(inputs, extent)[: step.num_logits]
        graph.graph.replay()
        return graph.logits[: step.num_logits]

    def capture_base(self) -> None:
        """The base-model graph of every bucket of each phase, largest first (the pool then serves the smaller
        ones), over padding: the warm-up forward writes only the pad block."""
        for phase, inputs in self.inputs.items():
            inputs.fill_padding()
            for bucket in sorted(self._buckets[phase], reverse=True):
                shape = StepShape(phase, bucket, None)
                extent = inputs.static_extent(shape)
                self.graphs.capture(shape, lambda extent=extent, inputs=inputs: self._forward(inputs, extent))

    def capture_idle(self, shape: StepShape) -> None:
        """Capture a planned shape's graph between steps (nothing in flight), over padding: it writes only the pad
        block. It stays while the shape is planned (`GraphCache.keep`)."""
        inputs = self.inputs[shape.phase]
        inputs.fill_padding()
        extent = inputs.static_extent(shape)
        self.graphs.capture(shape, lambda: self._forward(inputs, extent), is_planned=True)

    def _forward(self, inputs: StepInputs, extent: Extent) -> torch.Tensor:
        ctx = inputs.context(extent, self.lora_ops)
        hidden = self.model.forward(inputs.token_ids(extent), ctx)
        rows = inputs.logits_rows(extent)
        return self.model.compute_logits(hidden if rows is None else hidden.index_select(0, rows), ctx.lora, rows)
