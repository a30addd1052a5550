"""A request inside the engine: its tokens, progress and lifecycle status."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from kubelora.contract.errors import FailureKind
from kubelora.engine.prefix_key import block_key
from kubelora.engine.sampling_params import SamplingParams

PENDING_TOKEN = -1  # a sampled token still on the device (its step runs while the next one is scheduled)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self not in (SequenceStatus.WAITING, SequenceStatus.RUNNING)

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.is_finished else None


@dataclass(eq=False)
class Sequence:
    """Owned by the scheduler; the runner reads tokens, the detokenizer writes `text`.

    `adapter` is the opaque adapter revision the request is bound to (None: base model); it is released
    exactly once, when the sequence finishes (`adapter` becomes None then; `adapter_name` stays).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter_name: str | None
    adapter: object | None
    max_tokens: int  # params.max_tokens clipped to the room left by max_model_len
    arrival_time: float
    generator: torch.Generator | None = None
    grammar: object | None = None  # with params.structured: its matcher (engine/structured/matcher.py)
    # with params.allowed_token_ids: [ceil(vocab / 32)] int32 host bitmask of them (engine/sampling_batch.py)
    allowed_bitmask: torch.Tensor | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)  # sampled tokens the host has read back
    # Sampled tokens not read back yet (steps in flight, engine/engine.py): they follow output_token_ids.
    num_pending: int = 0
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache (or are being written by a step in flight)
    first_scheduled_time: float | None = None  # time.time() when a step first took some of its prompt
    first_token_time: float | None = None
    text: str = ""  # stable decoded output (stop strings removed, incomplete characters held back)
    # Incremental detokenization (engine/detokenizer.py): output_token_ids[:read_offset] decode to
    # decoded_text; [prefix_offset:read_offset] is the context re-decoded with the new tokens.
    decoded_text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    # Stop strings (engine/detokenizer.py): per stop, the longest suffix of decoded_text[:num_stop_scanned] that
    # is a proper prefix of it; each step scans only the characters decoded since.
    stop_states: list[int] = field(default_factory=list)
    num_stop_scanned: int = 0
    num_failed_steps: int = 0  # failed batches this request was in (engine/engine.py contains them)
    error: str | None = None
    error_kind: FailureKind | None = None  # set with FINISHED_ERROR, as `error` is
    num_preemptions: int = 0
    # Prefix caching (engine/block_manager.py): the key its block chain starts from (engine/prefix_key.py root_key;
    # None: it neither reads nor fills the cache), its known full blocks' keys (computed once each), and the prompt
    # tokens its first admission found cached (None until admitted).
    cache_root: bytes | None = None
    block_keys: list[bytes] = field(default_factory=list)
    num_cached_tokens: int | None = None
    prompt_logits: list[torch.Tensor] = field(default_factory=list)  # with params.return_logits: [vocab] each
    logits: list[torch.Tensor] = field(default_factory=list)
    # With params.logprobs / prompt_logprobs (engine/outputs.py PositionLogprobs): one per generated token;
    # one per prompt token after the first.
    output_logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)

    @property
    def fairness_key(self) -> str:
        return self.adapter_name or ""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, pending ones included."""
        return len(self.output_token_ids) + self.num_pending

    @property
    def num_tokens_before_sampled(self) -> int:
        """Generated tokens before the one a step samples now: its own token is the last pending one (counted
        when the step was scheduled); earlier pending ones (the step in flight's) come before it."""
        return len(self.output_token_ids) + max(self.num_pending - 1, 0)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """Still feeding known tokens (the prompt, or prompt + output after a preemption)."""
        return self.num_uncomputed_tokens > 1 or not self.num_output_tokens

    @property
    def reads_cache(self) -> bool:
        """Prompt logits or logprobs come from computing each prompt position: such requests compute them all."""
        return (self.cache_root is not None and not self.params.return_logits
                and self.params.prompt_logprobs is None)

    def full_block_keys(self, block_size: int) -> list[bytes]:
        """Keys of the full blocks of its tokens read back so far (pending ones are not known yet)."""
        num_known = len(self.prompt_token_ids) + len(self.output_token_ids)
        while (len(self.block_keys) + 1) * block_size <= num_known:
            start = len(self.block_keys) * block_size
            parent = self.block_keys[-1] if self.block_keys else self.cache_root
            self.block_keys.append(block_key(parent, self.token_ids(start, start + block_size)))
        return self.block_keys

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without joining the two lists (a decode step asks for one);
        pending positions are PENDING_TOKEN."""
        num_prompt = len(self.prompt_token_ids)
        num_known = num_prompt + len(self.output_token_ids)
        pending = [PENDING_TOKEN] * (end - max(start, num_known)) if end > num_known else []
        end = min(end, num_known)
        if end <= num_prompt:
            known = self.prompt_token_ids[start:end]
        elif start >= num_prompt:
            known = self.output_token_ids[start - num_prompt : end - num_prompt]
        else:
            known = self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]
        return known + pending if pending else known
