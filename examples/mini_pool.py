"""The mini engine's device block pool: reference counts, a prefix cache, and LRU reuse.

Like vLLM's block pool: a block whose content is complete is registered under its chained
hash; when its last user frees it, it stays cached in the free queue (least recently freed
first, tails before heads) until an allocation takes it over. Pure bookkeeping, no data.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.block_of: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    def cached_prefix(self, hashes: Sequence[bytes], max_blocks: int) -> list[int]:
        """Blocks of the longest cached prefix of ``hashes`` (at most ``max_blocks``)."""
        out = []
        for h in hashes[:max_blocks]:
            b = self.block_of.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def acquire(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached blocks (taking them off the free queue)."""
        for b in blocks:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks, evicting the least recently freed cached ones; None if short."""
        if n > len(self.free):
            return None
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            h = self.hash_of.pop(b, None)
            if h is not None and self.block_of.get(h) == b:
                del self.block_of[h]
            self.ref[b] = 1
            out.append(b)
        return out

    def register(self, block: int, h: bytes) -> None:
        """``block`` now holds the complete KV of the block with hash ``h``."""
        if h not in self.block_of and block not in self.hash_of:
            self.block_of[h] = block
            self.hash_of[block] = h

    def release(self, blocks: Sequence[int]) -> None:
        """Drop a reference; unused blocks go to the free queue, tails first (evicted first)."""
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None


if __name__ == "__main__":  # a library: say what it is and what to run instead
    from library_help import explain
    explain("mini_pool.py", __doc__)
