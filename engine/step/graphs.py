"""Captured CUDA graphs by step shape, decode and prefill alike: capture, keep or evict, replay.

A captured graph reads its inputs from the step inputs' fixed addresses (engine/step/inputs.py) and writes its
logits into a static output. Base-model graphs (`StepShape.lora` None) are captured at start-up and kept for good.
LoRA graphs are captured while the engine is idle for the shapes planned for the registered adapters
(engine/step/plan.py), which stay while they are planned (`keep`), and on a decode step's first use of another
shape; the least recently used of those others beyond MAX_LORA_GRAPHS are dropped. All graphs share one memory
pool.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from kubelora.engine.step.shape import StepShape

log = logging.getLogger(__name__)
MAX_LORA_GRAPHS = 64  # LoRA graphs outside the planned shapes kept; the least recently used beyond are dropped


@dataclass(frozen=True)
class Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # the static output every replay writes: [rows, vocab] float32


class GraphCache:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._graphs: dict[StepShape, Graph] = {}  # LoRA shapes in use order, most recent last
        self._pool = None
        self.pinned: frozenset[StepShape] = frozenset()  # planned shapes: out of the LRU bound
        self.num_captures = 0
        self.capture_seconds = 0.0

    def __contains__(self, shape: StepShape) -> bool:
        return shape in self._graphs

    def get(self, shape: StepShape) -> Graph | None:
        graph = self._graphs.get(shape)
        if graph is not None and shape.lora is not None:
            self._graphs[shape] = self._graphs.pop(shape)
        return graph

    def capture(self, shape: StepShape, forward: Callable[[], torch.Tensor], is_planned: bool = False) -> Graph:
        """Capture `forward` (over a static layout's inputs) as the graph of `shape`; is_planned: one of the
        registered adapters' planned shapes, kept while `keep` lists it."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph, logits, elapsed = capture_graph(self.device, self._pool, forward)
        self.num_captures += 1
        self.capture_seconds += elapsed
        log.info("captured %s graph bucket=%d lora=%s in %.3f s", shape.phase.value, shape.bucket, shape.lora,
                 elapsed)
        entry = self._graphs[shape] = Graph(graph, logits)
        if is_planned:
            self.pinned = self.pinned | {shape}
        evictable = [s for s in self._graphs if s.lora is not None and s not in self.pinned]
        if len(evictable) > MAX_LORA_GRAPHS:
            del self._graphs[evictable[0]]
        return entry

    def keep(self, wanted: Iterable[StepShape]) -> None:
        """The planned shapes are now `wanted`: graphs of shapes no longer planned join the LRU."""
        self.pinned &= frozenset(wanted)


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
