"""The prefix index of one attention kind's block pool: which block holds the prefix a key
names.

A block is registered once it is full and computed, and forgotten when its pool hands it
out again (`BlockPool` calls `forget` on reuse); the pool reuses free blocks least recently
freed first, so the index evicts least recently used prefixes first. A prefix computed twice
at the same time keeps its first copy: the duplicate stays private to its request.
"""

from __future__ import annotations

from muse.engine.prefix_keys import BlockKey


class PrefixIndex:
    def __init__(self) -> None:
        self.blocks: dict[BlockKey, int] = {}
        self.keys: dict[int, BlockKey] = {}

    def __len__(self) -> int:
        return len(self.blocks)

    def lookup(self, key: BlockKey) -> int | None:
        return self.blocks.get(key)

    def register(self, block: int, key: BlockKey) -> bool:
        """Name `block`'s contents by `key`; False (nothing changes) when the key is already
        held by another block or the block already has a key."""
        if block in self.keys or key in self.blocks:
            return False
        self.blocks[key] = block
        self.keys[block] = key
        return True

    def forget(self, block: int) -> BlockKey | None:
        """Drop `block`'s key (its contents are about to be overwritten); returns the key."""
        key = self.keys.pop(block, None)
        if key is not None:
            del self.blocks[key]
        return key

    def clear(self) -> None:
        self.blocks.clear()
        self.keys.clear()
