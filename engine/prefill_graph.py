"""Short one-sequence prefills replayed as CUDA graphs, one per token bucket (and per adapter shape).

An eager prefill pays the host cost of 32 layers of launches (at the 7B shape about 0.55 ms a layer with an
adapter's LoRA launches; docs/benchmarks-engine.md, "First request after /ready"), which for a short prompt is several times the GPU's own
time: a lone request's time to first token was the host's. A step that prefills one sequence's chunk of at most
`max(buckets)` tokens, with no per-token logits wanted, instead fills `PrefillInputs` (engine/prefill_inputs.py)
and replays the graph of its token bucket (`prefill_buckets`: multiples of the 16-token LoRA tile), padded to it;
the graph writes the chunk's last-token logits `[1, vocab]` float32 into a static output and sampling runs after
it, as after a decode graph.

Base-model graphs are captured at start-up for every bucket. Graphs for adapters are keyed by their `StepShape`
(engine/step/shape.py: projection kinds, rank lanes) and captured while the engine is idle for the registered adapters' common shapes
(engine/engine.py: capture_pending_graphs), never on a request's path: a chunk whose graph is not captured runs
eagerly. Batches of several sequences, longer chunks and chunks asking for prompt logprobs or logits run eagerly.
`EngineConfig.use_prefill_graphs=False` (`--no-prefill-graphs`, or `--enforce-eager`) turns this off.

Off CUDA (tests) the same static path runs eagerly: `StaticPrefill(..., use_graphs=False)`.
"""

from __future__ import annotations

import logging

import torch

from kubelora.engine.graph_runner import capture_graph
from kubelora.engine.model.llama import DecoderModel, ForwardContext, LoRAContext
from kubelora.engine.prefill_inputs import PrefillInputs, PrefillStep
from kubelora.engine.step.shape import Phase, StepShape, bucket_for, prefill_buckets

log = logging.getLogger(__name__)
class StaticPrefill:
    def __init__(self, model: DecoderModel, inputs: PrefillInputs, lora_backend: str, use_graphs: bool) -> None:
        self.model = model
        self.inputs = inputs
        self.lora_backend = lora_backend
        self.use_graphs = use_graphs
        self.buckets = prefill_buckets(inputs.max_tokens)
        self._graphs: dict[StepShape, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.num_captures = 0
        self.capture_seconds = 0.0

    def bucket_for(self, num_tokens: int) -> int | None:
        return bucket_for(self.buckets, num_tokens)

    def is_ready(self, shape: StepShape) -> bool:
        """Whether a chunk of this shape runs here: its graph is captured (always, off graphs)."""
        return not self.use_graphs or shape in self._graphs

    def has_graph(self, shape: StepShape) -> bool:
        return shape in self._graphs

    def keep(self, wanted: set[StepShape]) -> None:
        """Drop the adapter graphs outside `wanted` (shapes no longer registered); the base graphs stay."""
        for shape in [s for s in self._graphs if s.lora is not None and s not in wanted]:
            del self._graphs[shape]

    def capture_base(self) -> None:
        """The base-model graph of every bucket, largest first (the pool then serves the smaller ones)."""
        self.inputs.fill_padding()
        for bucket in sorted(self.buckets, reverse=True):
            self._capture(StepShape(Phase.PREFILL, bucket, None))

    def capture_idle(self, shape: StepShape) -> None:
        """Capture one graph between steps (nothing in flight), over padding: it writes only the pad block."""
        self.inputs.fill_padding()
        self._capture(shape)

    def run(self, step: PrefillStep, pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
            ) -> torch.Tensor:
        """The chunk's last-token logits [1, vocab] float32 (the graph's static output, or an eager forward's).

        pending: (rows, sources, tokens) device tensors: token_ids[rows] = tokens[sources] before the replay."""
        bucket = self.bucket_for(len(step.token_ids))
        shape = step.shape(bucket)
        self.inputs.fill(step, bucket, shape.lora)
        if pending is not None:
            rows, sources, tokens = pending
            self.inputs.token_ids(bucket)[rows] = tokens[sources]
        if not self.use_graphs:
            return self._forward(shape)
        graph, logits = self._graphs[shape]
        graph.replay()
        return logits

    def _forward(self, shape: StepShape) -> torch.Tensor:
        inputs, bucket, key = self.inputs, shape.bucket, shape.lora
        lora = None
        if key is not None:
            lora = LoRAContext(step=inputs.lora_step(bucket), proj=inputs.lora_projs(key), backend=self.lora_backend)
        ctx = ForwardContext(attention=inputs.attention(bucket), positions=inputs.positions(bucket), lora=lora)
        hidden = self.model.forward(inputs.token_ids(bucket), ctx)
        return self.model.compute_logits(hidden.index_select(0, inputs.last_row()))

    def _capture(self, shape: StepShape) -> None:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph, logits, elapsed = capture_graph(self.inputs.device, self._pool, lambda: self._forward(shape))
        self._graphs[shape] = (graph, logits)
        self.num_captures += 1
        self.capture_seconds += elapsed
        log.info("captured prefill graph bucket=%d lora=%s in %.3f s", shape.bucket, shape.lora, elapsed)
