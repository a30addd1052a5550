"""Paged KV cache bookkeeping: fixed-size blocks, a free list, one block table per sequence."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockManagerConfig:
    num_blocks: int
    block_size: int

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_blocks}")
        if not 1 <= self.block_size <= 1024:
            raise ValueError(f"kv_block_size must be in [1, 1024], got {self.block_size}")


class BlockManager:
    def __init__(self, config: BlockManagerConfig) -> None:
        self.block_size = config.block_size
        self.num_blocks = config.num_blocks
        self._free = list(range(config.num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def num_needed(self, seq_id: str, num_tokens: int) -> int:
        """Extra blocks a sequence needs so that its first `num_tokens` positions have a slot."""
        have = len(self._tables.get(seq_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def grow(self, seq_id: str, num_tokens: int) -> bool:
        """Allocate blocks up to `num_tokens` positions; False (and nothing allocated) if out of blocks."""
        needed = self.num_needed(seq_id, num_tokens)
        if needed > len(self._free):
            return False
        table = self._tables.setdefault(seq_id, [])
        table.extend(self._free.pop() for _ in range(needed))
        return True

    def table(self, seq_id: str) -> list[int]:
        return self._tables.get(seq_id, [])

    def free(self, seq_id: str) -> None:
        self._free.extend(reversed(self._tables.pop(seq_id, [])))
