"""Decode steps replayed as CUDA graphs, one per batch-size bucket (and per LoRA shape for steps with adapters).

A decode step's host cost (Python per layer, two LoRA launches per projection, small ops) is paid once at
capture instead of every step. The captured forward reads its inputs from `DecodeInputs` (static addresses
filled by one copy) and writes logits `[bucket, vocab]` float32 into a static output; sampling runs after
the replay, outside the graph. Base-only steps replay graphs without any LoRA launch, captured at start-up
for every bucket; a step with adapters replays the graph of its (bucket, LoRAKey), captured the first time
that shape is seen (tens to hundreds of milliseconds at 7B) and kept. While the engine is idle it captures the
graphs the registered adapters' shapes will need (`lora_graph_keys`, engine/engine.py), so the first requests
after start-up or a load do not wait for captures. All graphs share one memory pool.

Off CUDA (tests) the same static path runs eagerly: `StaticDecoder(..., use_graphs=False)`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kubelora.engine.adapters.staging import ShrinkStaging, stage_bucket
from kubelora.engine.decode_inputs import TILE_M, DecodeInputs, DecodeStep, LoRAKey, lora_key
from kubelora.engine.model.attention import DecodeMetadata
from kubelora.engine.model.llama import DecoderModel, ForwardContext, LoRAContext

log = logging.getLogger(__name__)
MAX_LORA_GRAPHS = 64  # graphs captured on first use kept; the least recently used beyond are dropped


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, then multiples of 16 up to max_num_seqs (which is always one)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


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
        self._graphs: dict[tuple[int, LoRAKey | None], _Graph] = {}
        self._pool = None
        # Graphs captured ahead for the registered adapters' shapes: out of the LRU bound (else the two would
        # take turns evicting and capturing each other's graphs).
        self.pinned: frozenset[tuple[int, LoRAKey]] = frozenset()
        self.num_captures = 0
        self.capture_seconds = 0.0

    def bucket_for(self, num_seqs: int) -> int | None:
        return next((b for b in self.buckets if b >= num_seqs), None)

    def lora_graph_keys(self, kinds: tuple[str, ...], lanes: int, num_adapters: int | None = None
                        ) -> list[tuple[int, LoRAKey]]:
        """The graphs steps over adapters of one shape (projection kinds, rank lanes; num_adapters registered) use
        most: per bucket, one token per adapter, two, and as many as a tile holds; with staged shrinks, the rows a
        full bucket of such steps stages."""
        keys = []
        for bucket in self.buckets:
            top = 1 << (min(bucket, TILE_M) - 1).bit_length()
            for rows in sorted({1, min(2, top), top}):
                adapters = -(-bucket // rows)  # at least this many adapters fill the bucket at `rows` tokens each
                if num_adapters is not None:
                    adapters = min(adapters, num_adapters)
                keys.append((bucket, LoRAKey(kinds, lanes, rows, self._stage_guess(kinds, lanes, adapters))))
        return keys

    def _stage_guess(self, kinds: tuple[str, ...], lanes: int, num_adapters: int) -> tuple[tuple[str, int], ...]:
        """LoRAKey.stage of a step over num_adapters adapters of rank `lanes` on every module of these kinds."""
        if self.staging is None:
            return ()
        stage = []
        for kind in kinds:
            if kind in self.staging.modules:
                rows = num_adapters * lanes * len(self.staging.modules[kind])
                if rows > self.staging.capacity[kind]:
                    return ()  # such a step runs its shrink launches (StagedStep: None)
                stage.append((kind, stage_bucket(rows, self.staging.capacity[kind])))
        return tuple(stage)

    def has_graph(self, bucket: int, key: LoRAKey | None) -> bool:
        return (bucket, key) in self._graphs

    def capture_idle(self, bucket: int, key: LoRAKey) -> None:
        """Capture one graph between steps (nothing in flight): over padding rows, so its warm-up forward
        writes only the pad block. It stays while its shape is among the registered adapters' (`pinned`)."""
        self.inputs.fill_padding()
        self._graph(bucket, key)
        self.pinned = self.pinned | {(bucket, key)}

    def capture_base(self) -> None:
        """Capture the base-model graph of every bucket, largest first (the pool then serves the smaller ones)."""
        self.inputs.fill_padding()
        for bucket in sorted(self.buckets, reverse=True):
            self._graph(bucket, None)

    def run(self, step: DecodeStep, pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
            ) -> torch.Tensor:
        """The step's logits [num_seqs, vocab] float32 (a view of the graph's static output).

        pending: (rows, sources, tokens) device tensors: token_ids[rows] = tokens[sources] before the replay, for
        tokens the previous step sampled and the host has not read back."""
        num = len(step.token_ids)
        bucket = self.bucket_for(num)
        key = lora_key(step)
        self.inputs.fill(step, bucket, key)
        if pending is not None:
            rows, sources, tokens = pending
            self.inputs.token_ids(bucket)[rows] = tokens[sources]
        entry = self._graph(bucket, key)
        if entry.graph is None:
            entry.logits.copy_(self._forward(bucket, key))
        else:
            entry.graph.replay()
        return entry.logits[:num]

    # ---- capture ----

    def _forward(self, bucket: int, key: LoRAKey | None) -> torch.Tensor:
        inputs = self.inputs
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

    def _graph(self, bucket: int, key: LoRAKey | None) -> _Graph:
        entry = self._graphs.get((bucket, key))
        if entry is not None:
            if key is not None:  # most recently used last
                self._graphs[(bucket, key)] = self._graphs.pop((bucket, key))
            return entry
        if not self.use_graphs:
            entry = _Graph(None, torch.empty(bucket, self.model.config.vocab_size, dtype=torch.float32,
                                             device=self.inputs.device))
        else:
            entry = self._capture(bucket, key)
        self._graphs[(bucket, key)] = entry
        evictable = [k for k in self._graphs if k[1] is not None and k not in self.pinned]
        if len(evictable) > MAX_LORA_GRAPHS:
            del self._graphs[evictable[0]]
        return entry

    def _capture(self, bucket: int, key: LoRAKey | None) -> _Graph:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph, logits, elapsed = capture_graph(self.inputs.device, self._pool, lambda: self._forward(bucket, key))
        self.num_captures += 1
        self.capture_seconds += elapsed
        log.info("captured decode graph bucket=%d lora=%s in %.3f s", bucket, key, elapsed)
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
