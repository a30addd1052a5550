"""Model runner: turns a scheduled `Batch` into device tensors once (`prepare_*`), runs the model, samples.

`execute` queues a step's work on the device and returns it as a `LaunchedStep` without waiting for it; its
`result()` waits for the sampled ids. The engine queues the two halves apart (`forward`, then `sample`) so that
the previous step is read back on the host while the device runs this step's forward pass. A batch may feed
tokens that the previous launched step sampled and the host has not read yet (`PENDING_TOKEN`,
engine/engine.py): they are copied on the device from that step's ids. Every step runs through the step executor
(engine/step/executor.py): its inputs filled into one device buffer, then a CUDA graph replayed or the same inputs
run eagerly.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from kubelora.engine.adapters.pool import SlotView, slot_tables, table_modules
from kubelora.engine.model.llama import DecoderModel
from kubelora.engine.sampler import SampledStep, TokenLogprobs, keep_top, prompt_logprobs, sample_on_device
from kubelora.engine.sampling_batch import prepare_sampling
from kubelora.engine.scheduler import Batch
from kubelora.engine.sequence import PENDING_TOKEN
from kubelora.engine.step.executor import StepExecutor
from kubelora.engine.step.inputs import Step
from kubelora.engine.step.shape import Phase, Tables


@dataclass(frozen=True)
class RunnerConfig:
    device: torch.device
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
    logits: torch.Tensor  # [rows, vocab] float32 on the device: the plan's rows
    plan: LogitsPlan


@dataclass(frozen=True)
class LogitsPlan:
    rows: list[int]  # batch token rows whose logits are computed, ascending
    chunk_rows: list[tuple[int, int]]  # per chunk: (first, end) into the logits rows; empty when none
    sample_rows: list[int | None]  # per chunk: logits row to sample from

    @property
    def is_every_row_sampled(self) -> bool:
        """A row per chunk, each sampled (a decode step's): the logits are sampled as they are."""
        return len(self.rows) == len(self.sample_rows) and None not in self.sample_rows


class ModelRunner:
    def __init__(self, model: DecoderModel, config: RunnerConfig, steps: StepExecutor) -> None:
        self.model = model
        self.config = config
        self.steps = steps

    def execute(self, batch: Batch, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queue the step (forward, then sampling); `previous`: the launched step whose ids the batch's pending
        tokens come from."""
        return self.sample(self.forward(batch, previous))

    def forward(self, batch: Batch, previous: LaunchedStep | None = None) -> ForwardStep:
        """Queue the forward pass only: sampling inputs (grammar masks, penalties) may still wait for the host
        to read `previous` back."""
        plan = prepare_logits_plan(batch)
        logits = self.steps.run(self.step_of(batch, plan.rows), _pending_tokens(batch, previous))
        return ForwardStep(batch, logits, plan)

    def sample(self, forward: ForwardStep) -> LaunchedStep:
        """Queue the sampling stage of a queued forward; the sequences' host state is read now."""
        batch, logits, plan = forward.batch, forward.logits, forward.plan
        rows = [r for r in plan.sample_rows if r is not None]
        sampled = None
        if rows:
            seqs = [c.seq for c, r in zip(batch.chunks, plan.sample_rows) if r is not None]
            sampled = sample_on_device(logits if plan.is_every_row_sampled else logits[rows],
                                       self._sampling_batch(seqs, logits.device))
        order = iter(range(len(rows)))
        return LaunchedStep(batch, sampled, [None if r is None else next(order) for r in plan.sample_rows],
                            logits=_chunk_logits(batch, logits, plan),
                            prompt_logprobs=_prompt_logprobs(batch, logits, plan))

    def step_of(self, batch: Batch, logits_rows: list[int]) -> Step:
        """The batch as the executor takes it: its adapters' slot tables compacted to the slots its chunks use, and
        a static decode step's shrinks staged where staging is on."""
        chunks = batch.chunks
        used = sorted({c.slot for c in chunks if c.slot >= 0})
        index = {slot: i for i, slot in enumerate(used)}
        slots = tuple(batch.slots[slot] for slot in used)
        num_tokens = sum(len(c.token_ids) for c in chunks)
        token_ids = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks), np.int64, num_tokens)
        step = Step(token_ids=np.maximum(token_ids, 0), query_lens=[len(c.token_ids) for c in chunks],
                    start_pos=[c.start_pos for c in chunks], block_tables=[c.block_table for c in chunks],
                    seq_slots=[index.get(c.slot, -1) for c in chunks],
                    slot_tables=self._slot_tables(slots) if slots else {}, logits_rows=logits_rows)
        if (slots and self.steps.staging is not None and step.is_decode
                and self.steps.bucket_for(Phase.DECODE, step.num_seqs) is not None):  # a static decode step
            # the step's A rows beside the base weights (None: more than the capacity)
            step = dataclasses.replace(step, staged=self.steps.staging.stage(slots))
        return step

    def _slot_tables(self, slots: tuple[SlotView, ...]) -> Tables:
        return slot_tables(slots, table_modules(self.model.config))

    def _sampling_batch(self, seqs: list, device: torch.device):
        return prepare_sampling(seqs, self.model.config.vocab_size, device, self.config.eos_token_ids)


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


def prepare_logits_plan(batch: Batch) -> LogitsPlan:
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
    return LogitsPlan(rows=rows, chunk_rows=chunk_rows, sample_rows=sample_rows)


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

