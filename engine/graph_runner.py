"""Decode steps replayed as CUDA graphs, one per batch-size bucket (and per LoRA shape for steps with adapters).

A decode step's host cost (Python per layer, two LoRA launches per projection, small ops) is paid once at
capture instead of every step. The captured forward reads its inputs from `DecodeInputs` (static addresses
filled by one copy) and writes logits `[bucket, vocab]` float32 into a static output; sampling runs after
the replay, outside the graph. Base-only steps replay graphs without any LoRA launch, captured at start-up
for every bucket; a step with adapters replays the graph of its `StepShape` (engine/step/shape.py), captured the
first time that shape is seen (tens to hundreds of milliseconds at 7B) and kept. While the engine is idle it
captures the graphs the registered adapters' shapes will need (engine/graph_plan.py), so the first requests
after start-up or a load do not wait for captures. All graphs share one memory pool.

Off CUDA (tests) the same static path runs eagerly: `StaticDecoder(..., use_graphs=False)`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kubelora.engine.adapters.staging import ShrinkStaging
from kubelora.engine.decode_inputs import DecodeInputs, DecodeStep
from kubelora.engine.model.attention import DecodeMetadata
from kubelora.engine.model.llama import DecoderModel, ForwardContext, LoRAContext
from kubelora.engine.step.shape import Phase, StepShape, bucket_for, decode_buckets

log = logging.getLogger(__name__)
MAX_LORA_GRAPHS = 64  # graphs captured on first use kept; the least recently used beyond are dropped


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None
    logits: torch.Tensor  # [bucket, vocab] float32, written by every replay


class StaticDecoder:
    def __init__(self, model: DecoderModel, inputs: DecodeInputs, lora_backend: str, use_graphs: bool,
                 staging: ShrinkStaging | None = None) -> None:
        self.model = model
        self.staging = staging  # staged shrinks for steps with adapters (engine/adapters/staging.py); None: off
        self.inputs = inputs
        self.lora_backend = lora_backend
        self.use_graphs = use_graphs
        self.buckets = decode_buckets(inputs.max_seqs)
        self._graphs: dict[StepShape, _Graph] = {}
        self._pool = None
        # Graphs captured ahead for the registered adapters' shapes: out of the LRU bound (else the two would
        # take turns evicting and capturing each other's graphs).
        self.pinned: frozenset[StepShape] = frozenset()
        self.num_captures = 0
        self.capture_seconds = 0.0

    def bucket_for(self, num_seqs: int) -> int | None:
        return bucket_for(self.buckets, num_seqs)

    def has_graph(self, shape: StepShape) -> bool:
        return shape in self._graphs

    def capture_idle(self, shape: StepShape) -> None:
        """Capture one graph between steps (nothing in flight): over padding rows, so its warm-up forward
        writes only the pad block. It stays while its shape is among the registered adapters' (`pinned`)."""
        self.inputs.fill_padding()
        self._graph(shape)
        self.pinned = self.pinned | {shape}

    def capture_base(self) -> None:
        """Capture the base-model graph of every bucket, largest first (the pool then serves the smaller ones)."""
        self.inputs.fill_padding()
        for bucket in sorted(self.buckets, reverse=True):
            self._graph(StepShape(Phase.DECODE, bucket, None))

    def run(self, step: DecodeStep, pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
            ) -> torch.Tensor:
        """The step's logits [num_seqs, vocab] float32 (a view of the graph's static output).

        pending: (rows, sources, tokens) device tensors: token_ids[rows] = tokens[sources] before the replay, for
        tokens the previous step sampled and the host has not read back."""
        num = len(step.token_ids)
        bucket = self.bucket_for(num)
        shape = step.shape(bucket)
        self.inputs.fill(step, bucket, shape.lora)
        if pending is not None:
            rows, sources, tokens = pending
            self.inputs.token_ids(bucket)[rows] = tokens[sources]
        entry = self._graph(shape)
        if entry.graph is None:
            entry.logits.copy_(self._forward(shape))
        else:
            entry.graph.replay()
        return entry.logits[:num]

    # ---- capture ----

    def _forward(self, shape: StepShape) -> torch.Tensor:
        inputs, bucket, key = self.inputs, shape.bucket, shape.lora
        positions = inputs.positions(bucket)
        attention = DecodeMetadata(slot_mapping=inputs.slot_mapping(bucket), block_tables=inputs.block_tables(bucket),
                                   context_lens=inputs.context_lens(bucket))
        lora = None
        if key is not None:
            lora = LoRAContext(step=inputs.lora_step(bucket, key), proj=inputs.lora_projs(key),
                               backend=self.lora_backend, stage=dict(key.stage))
        ctx = ForwardContext(attention=attention, positions=positions, lora=lora)
        hidden = self.model.forward(inputs.token_ids(bucket), ctx)
        return self.model.compute_logits(hidden)

    def _graph(self, shape: StepShape) -> _Graph:
        entry = self._graphs.get(shape)
        if entry is not None:
            if shape.lora is not None:  # most recently used last
                self._graphs[shape] = self._graphs.pop(shape)
            return entry
        if not self.use_graphs:
            entry = _Graph(None, torch.empty(shape.bucket, self.model.config.vocab_size, dtype=torch.float32,
                                             device=self.inputs.device))
        else:
            entry = self._capture(shape)
        self._graphs[shape] = entry
        evictable = [k for k in self._graphs if k.lora is not None and k not in self.pinned]
        if len(evictable) > MAX_LORA_GRAPHS:
            del self._graphs[evictable[0]]
        return entry

    def _capture(self, shape: StepShape) -> _Graph:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph, logits, elapsed = capture_graph(self.inputs.device, self._pool, lambda: self._forward(shape))
        self.num_captures += 1
        self.capture_seconds += elapsed
        log.info("captured decode graph bucket=%d lora=%s in %.3f s", shape.bucket, shape.lora, elapsed)
        return _Graph(graph, logits)


@torch.inference_mode()
def capture_graph(device: torch.device, pool, forward: Callable[[], torch.Tensor]
                  ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, float]:
    """(graph, its static output, seconds): `forward` run once on a side stream (kernel compiles, library handles,
    none of it captured), then captured into `pool`, then replayed once over the same inputs, so that what a
    graph's first launch costs (CUDA uploads an instantiated graph on its first launch unless it was uploaded
    before) is paid here rather than by the first step that replays it."""
    started = time.perf_counter()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread_local: adapter loader threads may pin host memory meanwhile (a global capture forbids that to
    # every thread); nothing but this thread launches device work.
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        output = forward()
    graph.replay()
    torch.cuda.synchronize(device)
    return graph, output, time.perf_counter() - started
