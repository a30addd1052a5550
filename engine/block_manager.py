"""Paged KV cache bookkeeping: fixed-size blocks, one block table per sequence, and the prefix cache.

A block is free (on the free list, no key), used (referenced by the tables of one or more sequences) or cached
(nobody references it, but it keeps its key: engine/prefix_key.py). Full blocks whose K/V a finished step wrote
are offered to the cache under their key (`cache`); a sequence being admitted takes the cached blocks of its
longest cached prefix (`take_cached`) and shares them, read-only: steps only write positions past a sequence's
computed tokens, and a shared block is full. Cached blocks nobody uses stay until an allocation finds the free
list empty; then the least recently released one loses its key and is handed out (LRU). So free-block accounting
counts cached blocks nobody uses as available.
"""

from __future__ import annotations

from collections import OrderedDict
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
        self._refs = [0] * config.num_blocks  # per block: the tables holding it
        self._tables: dict[str, list[int]] = {}
        self._block_of: dict[bytes, int] = {}  # key -> the cached block holding it
        self._key_of: dict[int, tuple[bytes, object]] = {}  # cached block -> (its key, the adapter that computed it)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody uses, least recent first
        self._num_offered: dict[str, int] = {}  # per sequence: its leading blocks already offered to the cache

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free ones and cached ones nobody uses."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks that hold a key (used or not)."""
        return len(self._key_of)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def num_needed(self, seq_id: str, num_tokens: int) -> int:
        """Extra blocks a sequence needs so that its first `num_tokens` positions have a slot."""
        have = len(self._tables.get(seq_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def grow(self, seq_id: str, num_tokens: int) -> bool:
        """Allocate blocks up to `num_tokens` positions; False (and nothing allocated) if out of blocks."""
        needed = self.num_needed(seq_id, num_tokens)
        if needed > self.num_free:
            return False
        table = self._tables.setdefault(seq_id, [])
        table.extend(self._allocate() for _ in range(needed))
        return True

    def take_cached(self, seq_id: str, keys: list[bytes]) -> int:
        """A sequence without blocks takes the cached blocks of the longest prefix of `keys` (its full blocks'
        keys, in order); returns how many it took."""
        table = self._tables.setdefault(seq_id, [])
        if table:
            raise RuntimeError(f"sequence {seq_id} already holds {len(table)} KV blocks")
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            self._evictable.pop(block, None)
            self._refs[block] += 1
            table.append(block)
        self._num_offered[seq_id] = len(table)
        return len(table)

    def cache(self, seq_id: str, step_table: tuple[int, ...], keys: list[bytes], num_blocks: int,
              adapter: object) -> None:
        """Offer a sequence's first `num_blocks` blocks, full and written by steps read back, to the cache: block i
        under keys[i], while the sequence still holds it at index i of the table the step wrote (`step_table`; a
        sequence preempted since holds other blocks, or none). A key already cached elsewhere leaves this block
        uncached. `adapter`: what computed them (its cached blocks are dropped with `drop`)."""
        table = self._tables.get(seq_id)
        if not table:
            return
        first = self._num_offered.get(seq_id, 0)
        end = min(num_blocks, len(keys), len(step_table), len(table))
        for i in range(first, end):
            if table[i] != step_table[i]:
                break
            block, key = table[i], keys[i]
            if block not in self._key_of and key not in self._block_of:
                self._key_of[block] = (key, adapter)
                self._block_of[key] = block
            self._num_offered[seq_id] = i + 1

    def table(self, seq_id: str) -> list[int]:
        return self._tables.get(seq_id, [])

    def free(self, seq_id: str) -> None:
        """Release a sequence's blocks. Cached ones nobody else uses are kept, its last block first to be evicted
        (a prefix's first blocks are shared more often than its last)."""
        self._num_offered.pop(seq_id, None)
        for block in reversed(self._tables.pop(seq_id, [])):
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            if block in self._key_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def drop(self, adapter: object) -> int:
        """Uncache every block `adapter` computed (it was unloaded or replaced): none is found again; unused ones
        go back to the free list. Returns how many were dropped."""
        blocks = [b for b, (_, owner) in self._key_of.items() if owner is adapter]
        for block in blocks:
            self._forget(block)
            if block in self._evictable:
                del self._evictable[block]
                self._free.append(block)
        return len(blocks)

    def _allocate(self) -> int:
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            self._forget(block)
        self._refs[block] = 1
        return block

    def _forget(self, block: int) -> None:
        key, _ = self._key_of.pop(block)
        del self._block_of[key]
