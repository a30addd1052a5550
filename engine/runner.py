"""Model runner: turns a scheduled `Batch` into device tensors once (`prepare_*`), runs the model, samples.

`execute` queues a step's work on the device and returns it as a `LaunchedStep` without waiting for it; its
`result()` waits for the sampled ids. The engine queues the two halves apart (`forward`, then `sample`) so that
the previous step is read back on the host while the device runs this step's forward pass. A batch may feed
tokens that the previous launched step sampled and the host has not read yet (`PENDING_TOKEN`,
engine/engine.py): they are copied on the device from that step's ids. Decode steps and one sequence's short
prefill chunks run from static layouts (engine/step/static.py: CUDA graphs, or the same inputs eagerly); the
rest run eagerly from `prepare_inputs`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from kubelora.engine.adapters.pool import SlotView
from kubelora.engine.model.attention import prepare_attention, prepare_decode_attention, prepare_prefill_attention
from kubelora.engine.model.config import PROJ_KINDS
from kubelora.engine.model.llama import DecoderModel, ForwardContext, LoRAContext
from kubelora.engine.sampler import SampledStep, TokenLogprobs, keep_top, prompt_logprobs, sample_on_device
from kubelora.engine.sampling_batch import prepare_sampling
from kubelora.engine.scheduler import Batch
from kubelora.engine.sequence import PENDING_TOKEN
from kubelora.engine.step.decode import DecodeStep
from kubelora.engine.step.prefill import PrefillStep
from kubelora.engine.step.shape import Phase, StepShape
from kubelora.engine.step.static import StaticSteps
from kubelora.kernels.lora import lora_ops, prepare_lora_projs, prepare_lora_step


@dataclass(frozen=True)
class RunnerConfig:
    device: torch.device
    block_size: int
    lora_backend: str
    # Attention reads the paged cache in place (kernels/attention.py) instead of gathering it into a padded batch
    is_paged_attention: bool = False
    eos_token_ids: tuple[int, ...] = ()  # banned by the sampler while a request has fewer than min_tokens


@dataclass(frozen=True)
class StepResult:
    sampled: list[int | None]  # per chunk: the new token, None for a chunk in the middle of a prefill
    logits: list[torch.Tensor | None]  # per chunk with params.return_logits: [len(chunk), vocab] on the host
    logprobs: list[TokenLogprobs | None] | None = None  # per chunk: the sampled token's, where asked
    # per chunk with params.prompt_logprobs: one per prompt token after the chunk's positions (the next token)
    prompt_logprobs: list[list[TokenLogprobs] | None] | None = None


@dataclass
class LaunchedStep:
    """A step whose work is queued on the device. `result()` waits for its sampled ids (once)."""

    batch: Batch
    sampled: SampledStep | None  # None: no chunk samples
    sample_rows: list[int | None]  # per chunk: its row in sampled.tokens
    logits: list[torch.Tensor | None]
    prompt_logprobs: list[list[TokenLogprobs] | None] | None
    rows: dict[str, int] = field(default_factory=dict)  # request id -> row in sampled.tokens
    _result: StepResult | None = None

    def __post_init__(self) -> None:
        self.rows = {c.seq.request_id: r for c, r in zip(self.batch.chunks, self.sample_rows) if r is not None}

    def result(self) -> StepResult:
        if self._result is None:
            out = self.sampled.result() if self.sampled is not None else None
            tokens = out.token_ids if out is not None else []
            logprobs = out.logprobs if out is not None else []
            self._result = StepResult(
                sampled=[None if r is None else tokens[r] for r in self.sample_rows], logits=self.logits,
                logprobs=[None if r is None else logprobs[r] for r in self.sample_rows],
                prompt_logprobs=self.prompt_logprobs)
        return self._result


@dataclass(frozen=True)
class ForwardStep:
    """A step whose forward pass is queued on the device; `ModelRunner.sample` queues its sampling stage."""

    batch: Batch
    logits: torch.Tensor  # [rows, vocab] float32 on the device
    plan: LogitsPlan | None  # None: a decode step's (a row per chunk, each sampled)


@dataclass(frozen=True)
class LogitsPlan:
    rows: torch.Tensor | None  # [num_rows] int64: batch token rows whose logits are computed (None: a static step's)
    chunk_rows: list[tuple[int, int]]  # per chunk: (first, end) into the logits rows; empty when none
    sample_rows: list[int | None]  # per chunk: logits row to sample from


class ModelRunner:
    def __init__(self, model: DecoderModel, config: RunnerConfig, static: StaticSteps | None = None) -> None:
        self.model = model
        self.config = config
        self.static = static  # decode steps and short prefill chunks from static layouts; None: every step eager
        self.lora_ops = lora_ops(config.lora_backend)

    def execute(self, batch: Batch, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queue the step (forward, then sampling); `previous`: the launched step whose ids the batch's pending
        tokens come from."""
        return self.sample(self.forward(batch, previous))

    def forward(self, batch: Batch, previous: LaunchedStep | None = None) -> ForwardStep:
        """Queue the forward pass only: sampling inputs (grammar masks, penalties) may still wait for the host
        to read `previous` back."""
        pending = _pending_tokens(batch, previous)
        static = self._static_step(batch) if self.static is not None else None
        if static is not None:
            step, shape = static
            logits = self.static.run(step, shape, pending)
            plan = None if shape.phase is Phase.DECODE else _one_row_plan(batch.chunks[0].is_sampled)
            return ForwardStep(batch, logits, plan)
        token_ids, ctx = self.prepare_inputs(batch)
        if pending is not None:
            rows, sources, tokens = pending
            token_ids[rows] = tokens[sources]
        plan = prepare_logits_plan(batch, self.config.device)
        hidden = self.model.forward(token_ids, ctx)
        return ForwardStep(batch, self.model.compute_logits(hidden[plan.rows]), plan)

    def sample(self, forward: ForwardStep) -> LaunchedStep:
        """Queue the sampling stage of a queued forward; the sequences' host state is read now."""
        batch, logits, plan = forward.batch, forward.logits, forward.plan
        if plan is None:  # a static decode step: one logits row per chunk, every one sampled
            seqs = [c.seq for c in batch.chunks]
            sampled = sample_on_device(logits, self._sampling_batch(seqs, logits.device))
            return LaunchedStep(batch, sampled, list(range(len(seqs))), logits=[None] * len(seqs),
                                prompt_logprobs=None)
        rows = [r for r in plan.sample_rows if r is not None]
        sampled = None
        if rows:
            seqs = [c.seq for c, r in zip(batch.chunks, plan.sample_rows) if r is not None]
            sampled = sample_on_device(logits[rows], self._sampling_batch(seqs, logits.device))
        order = iter(range(len(rows)))
        return LaunchedStep(batch, sampled, [None if r is None else next(order) for r in plan.sample_rows],
                            logits=_chunk_logits(batch, logits, plan),
                            prompt_logprobs=_prompt_logprobs(batch, logits, plan))

    def _static_step(self, batch: Batch) -> tuple[DecodeStep | PrefillStep, StepShape] | None:
        """The batch as a static step and its shape, where a layout holds it and its graph runs; else None."""
        step = self._decode_step(batch)
        if step is None:
            step = self._prefill_step(batch)
        if step is None:
            return None
        shape = step.shape(self.static.bucket_for(step.phase, len(step.token_ids)))
        return (step, shape) if self.static.is_ready(shape) else None

    def _decode_step(self, batch: Batch) -> DecodeStep | None:
        """One sampled token per sequence, no logits kept, and a bucket that holds the batch."""
        chunks = batch.chunks
        if (self.static.bucket_for(Phase.DECODE, len(chunks)) is None
                or not all(len(c.token_ids) == 1 and c.is_sampled and not c.seq.params.return_logits for c in chunks)):
            return None
        tables, staged = {}, None
        if batch.slots:
            tables = self._slot_tables(batch.slots)
            if self.static.staging is not None:  # the step's A rows beside the base weights (None: too many)
                staged = self.static.staging.stage(batch.slots)
        return DecodeStep(token_ids=[max(c.token_ids[0], 0) for c in chunks], positions=[c.start_pos for c in chunks],
                          block_tables=[c.block_table for c in chunks], token_slots=[c.slot for c in chunks],
                          slot_tables=tables, staged=staged)

    def _prefill_step(self, batch: Batch) -> PrefillStep | None:
        """One sequence's chunk of several tokens that a bucket holds, with only its last token's logits wanted."""
        if len(batch.chunks) != 1:
            return None
        chunk = batch.chunks[0]
        num = len(chunk.token_ids)
        if (num < 2 or self.static.bucket_for(Phase.PREFILL, num) is None or chunk.seq.params.return_logits
                or _num_prompt_targets(chunk)):
            return None
        tables = self._slot_tables(batch.slots[chunk.slot : chunk.slot + 1]) if chunk.slot >= 0 else None
        return PrefillStep(token_ids=[max(t, 0) for t in chunk.token_ids], start_pos=chunk.start_pos,
                           block_table=tuple(chunk.block_table), slot_tables=tables)

    def _slot_tables(self, slots: tuple[SlotView, ...]) -> dict[str, tuple[list, list, list]]:
        return {kind: _kind_tables(slots, self.model.config.kind_modules(kind)) for kind in PROJ_KINDS}

    def _sampling_batch(self, seqs: list, device: torch.device):
        return prepare_sampling(seqs, self.model.config.vocab_size, device, self.config.eos_token_ids)

    def prepare_inputs(self, batch: Batch) -> tuple[torch.Tensor, ForwardContext]:
        device = self.config.device
        num_tokens = sum(len(c.token_ids) for c in batch.chunks)
        token_ids = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in batch.chunks), np.int64, num_tokens)
        positions = torch.cat([torch.arange(c.start_pos, c.start_pos + len(c.token_ids)) for c in batch.chunks])
        if self.config.is_paged_attention and all(len(c.token_ids) == 1 for c in batch.chunks):
            attention = prepare_decode_attention([c.start_pos for c in batch.chunks],
                                                 [list(c.block_table) for c in batch.chunks],
                                                 self.config.block_size, device)
        elif self.config.is_paged_attention:
            attention = prepare_prefill_attention([len(c.token_ids) for c in batch.chunks],
                                                  [c.start_pos + len(c.token_ids) for c in batch.chunks],
                                                  [list(c.block_table) for c in batch.chunks],
                                                  self.config.block_size, device)
        else:
            attention = prepare_attention(
                query_lens=[len(c.token_ids) for c in batch.chunks],
                context_lens=[c.start_pos + len(c.token_ids) for c in batch.chunks],
                block_tables=[list(c.block_table) for c in batch.chunks],
                block_size=self.config.block_size,
                windows=self.model.windows,
                device=device,
            )
        ctx = ForwardContext(attention=attention, positions=positions.to(device), lora=self.prepare_lora(batch))
        return torch.from_numpy(token_ids).to(device), ctx

    def prepare_lora(self, batch: Batch) -> LoRAContext | None:
        """One LoRAStep (token -> slot) and one LoRAProj per projection kind, shared by every layer."""
        if not batch.slots:
            return None
        # Each chunk's slot repeated over its tokens, without a Python loop over a prefill's thousands of tokens.
        token_slots = np.repeat([c.slot for c in batch.chunks], [len(c.token_ids) for c in batch.chunks])
        step = prepare_lora_step(token_slots, len(batch.slots), self.config.device)
        proj = prepare_lora_projs(self._slot_tables(batch.slots), self.config.device)  # one host->device copy
        return LoRAContext(step=step, proj=proj, ops=self.lora_ops)

def _pending_tokens(batch: Batch, previous: LaunchedStep | None):
    """(rows, sources, tokens): the batch's token rows fed a pending token, and their rows in `previous`'s ids."""
    rows, sources = [], []
    token = 0
    for chunk in batch.chunks:
        token += len(chunk.token_ids)
        if chunk.token_ids[-1] == PENDING_TOKEN:  # pending tokens end a sequence: one at most (the last step's)
            if previous is None or chunk.seq.request_id not in previous.rows:
                raise RuntimeError(f"request {chunk.seq.request_id}: a pending token without the step sampling it")
            rows.append(token - 1)
            sources.append(previous.rows[chunk.seq.request_id])
    if not rows:
        return None
    tokens = previous.sampled.tokens
    index = torch.tensor([rows, sources], dtype=torch.int64)
    if tokens.device.type == "cuda":  # a pageable copy would wait for the step in flight
        index = index.pin_memory().to(tokens.device, non_blocking=True)
    return index[0], index[1], tokens


def _kind_tables(slots: tuple[SlotView, ...], modules: tuple[str, ...]) -> tuple[list, list, list]:
    """One projection kind's (row_start, rank, scale) per slot and module, as `prepare_lora_projs` takes them."""
    row_start = [[view.row_start.get(m, 0) for m in modules] for view in slots]
    rank = [[view.rank.get(m, 0) for m in modules] for view in slots]
    scale = [[view.scale.get(m, 0.0) for m in modules] for view in slots]
    return row_start, rank, scale


def _one_row_plan(is_sampled: bool) -> LogitsPlan:
    """The logits plan of a static prefill step: its one row, the chunk's last token."""
    return LogitsPlan(rows=None, chunk_rows=[(0, 1)], sample_rows=[0 if is_sampled else None])


def prepare_logits_plan(batch: Batch, device: torch.device) -> LogitsPlan:
    """Logits only where needed: the last token of sampled chunks, every token with return_logits or with
    prompt logprobs still to compute."""
    rows, chunk_rows, sample_rows = [], [], []
    token = 0
    for chunk in batch.chunks:
        num = len(chunk.token_ids)
        first = len(rows)
        if chunk.seq.params.return_logits or _num_prompt_targets(chunk):
            rows.extend(range(token, token + num))
        elif chunk.is_sampled:
            rows.append(token + num - 1)
        chunk_rows.append((first, len(rows)))
        sample_rows.append(len(rows) - 1 if chunk.is_sampled else None)
        token += num
    return LogitsPlan(rows=torch.tensor(rows, dtype=torch.int64, device=device), chunk_rows=chunk_rows,
                      sample_rows=sample_rows)


def _chunk_logits(batch: Batch, logits: torch.Tensor, plan: LogitsPlan) -> list[torch.Tensor | None]:
    out = []
    for chunk, (first, end) in zip(batch.chunks, plan.chunk_rows):
        out.append(logits[first:end].cpu() if chunk.seq.params.return_logits else None)
    return out


def _num_prompt_targets(chunk) -> int:
    """Prompt tokens whose logprob this chunk's logits give (the token after each position, inside the prompt)."""
    if chunk.seq.params.prompt_logprobs is None:
        return 0
    return max(0, min(len(chunk.token_ids), len(chunk.seq.prompt_token_ids) - 1 - chunk.start_pos))


def _prompt_logprobs(batch: Batch, logits: torch.Tensor, plan: LogitsPlan) -> list[list[TokenLogprobs] | None]:
    """Every chunk's prompt logprobs from one log_softmax over their rows and one device -> host copy."""
    rows, targets, counts = [], [], []
    for chunk, (first, _) in zip(batch.chunks, plan.chunk_rows):
        num = _num_prompt_targets(chunk)
        counts.append(num)
        rows.extend(range(first, first + num))
        targets.extend(chunk.seq.prompt_token_ids[chunk.start_pos + 1 : chunk.start_pos + 1 + num])
    if not rows:
        return [None] * len(batch.chunks)
    k = max(c.seq.params.prompt_logprobs for c, n in zip(batch.chunks, counts) if n)
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    entries = iter(prompt_logprobs(logits[index], torch.tensor(targets, device=logits.device), k))
    out = []
    for chunk, num in zip(batch.chunks, counts):
        kept = chunk.seq.params.prompt_logprobs or 0
        out.append([keep_top(next(entries), kept) for _ in range(num)] if num else None)
    return out

