"""The blocks of one attention kind: reference counts and the order free blocks are reused in.

Block 0 is the null block: never handed out, it fills table entries a sliding layer no longer
needs. A block whose last holder releases it joins the end of the free list, and
`allocate` takes the head: never used blocks first, then released ones, least recently
released first. A free block may still hold a cached prefix; whoever must know before it is
overwritten (the prefix index) is told through `on_reuse`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

NULL_BLOCK = 0


class BlockPool:
    def __init__(self, num_blocks: int, on_reuse: Callable[[int], object] | None = None
                 ) -> None:
        if num_blocks < 2:
            raise ValueError(f"a KV block pool needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.on_reuse = on_reuse
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self.free)

    def allocate(self) -> int:
        block, _ = self.free.popitem(last=False)
        if self.on_reuse is not None:
            self.on_reuse(block)
        self.ref_counts[block] = 1
        return block

    def acquire(self, block: int) -> None:
        """Take one more reference to a cached or shared block."""
        if self.ref_counts[block] == 0:
            del self.free[block]
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        if block == NULL_BLOCK:
            return
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free[block] = None
