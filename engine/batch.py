"""What the scheduler hands to the runner each step, its limits, and what it needs from the adapter manager."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kubelora.engine.adapters.types import Residency
from kubelora.engine.sequence import Sequence


class AdapterPlacer(Protocol):
    """What the scheduler needs from the adapter manager (a fake in unit tests)."""

    def ensure_device(self, revision: object, protected: set) -> Residency: ...
    def take_load_error(self, revision: object) -> str | None: ...
    def release(self, revision: object) -> None: ...
    def slot_view(self, revision: object) -> object: ...


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_loras: int | None  # None: no count limit, the device pool's bytes decide
    max_waiting: int
    eos_token_ids: tuple[int, ...] = ()
    # While requests wait for room in the device adapter pool, an adapter keeps its room for this many steps,
    # then its requests pause (their KV cache kept) so that waiting adapters get a turn.
    lora_time_slice_steps: int = 16

    def __post_init__(self) -> None:
        for field in ("max_num_seqs", "max_num_batched_tokens", "max_loras", "max_waiting", "lora_time_slice_steps"):
            if getattr(self, field) is not None and getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    token_ids: tuple[int, ...]  # the tokens fed this step
    start_pos: int  # position of token_ids[0]
    block_table: tuple[int, ...]  # the sequence's KV blocks, covering start_pos + len(token_ids) positions
    slot: int  # index into Batch.slots; -1 = base model
    is_sampled: bool  # the chunk reaches the end of the known tokens: sample the next one


@dataclass(frozen=True)
class Batch:
    chunks: tuple[ScheduledChunk, ...]
    slots: tuple[object, ...]  # per slot: the adapter's pool placement (SlotView), addresses valid this step

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)
