"""Paged KV-cache bookkeeping: one block pool per attention kind, and the prefix cache.

Layers of one kind (all sliding layers, or all global layers) share block ids: a request has one
block table per kind, and block `b` of a kind means slot range [b*block_size, (b+1)*block_size)
in every layer of that kind. Block 0 of each pool is the null block: it is never handed out, and
fills table entries a sliding layer no longer needs.

Prefix cache: every full block is keyed by (key of the previous block, its token ids), so a key
names a whole prefix; a block that holds media tokens adds the content hashes of those items.
A block whose last user leaves keeps its key and stays in the pool's free list (least
recently freed first out) until it is reused, so a later request with the same prefix can
take it back.

When a cached prefix of `P` tokens may be reused (`P` a multiple of the block size, and at most
prompt length - 1 so at least one token is computed to give logits):
- global layers: every block of [0, P) is cached;
- sliding layers: the query at position P sees keys (P - window, P], so the blocks covering
  [max(0, P - window + 1), P) must be cached; older blocks are not needed.
The longest P that every kind accepts wins.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from muse.config import SLIDING
from muse.engine.request import Request
from muse.multimodal.engine_inputs import block_media_hashes

NULL_BLOCK = 0
# (hash of the previous block's key, token ids of this block[, content hashes of the media
# items whose spans meet the block])
BlockKey = tuple


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens served from the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def window_start_block(kind: str, position: int, sliding_window: int | None,
                       block_size: int) -> int:
    """First block a query at `position` (or later) can still need in layers of `kind`."""
    if kind != SLIDING or sliding_window is None:
        return 0
    return max(0, position - sliding_window + 1) // block_size


class BlockPool:
    """The blocks of one attention kind, with reference counts and cached keys."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a KV block pool needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.keys: list[BlockKey | None] = [None] * num_blocks
        self.cached: dict[BlockKey, int] = {}
        # Blocks nobody holds, in the order they should be reused (cached ones are evictable).
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self.free)

    def allocate(self) -> int:
        block, _ = self.free.popitem(last=False)
        key = self.keys[block]
        if key is not None:  # evict the cached prefix this block held
            del self.cached[key]
            self.keys[block] = None
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

    def lookup(self, key: BlockKey) -> int | None:
        return self.cached.get(key)

    def register(self, block: int, key: BlockKey) -> None:
        # Keep the first copy of a prefix; a duplicate computed at the same time stays private.
        if self.keys[block] is None and key not in self.cached:
            self.cached[key] = block
            self.keys[block] = key


@dataclass
class RequestBlocks:
    tables: dict[str, list[int]] = field(default_factory=dict)
    keys: list[BlockKey] = field(default_factory=list)  # keys of the request's full blocks
    num_registered: dict[str, int] = field(default_factory=dict)


class KVCacheManager:
    def __init__(self, block_size: int, num_blocks: dict[str, int], sliding_window: int | None,
                 enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        self.pools = {kind: BlockPool(n) for kind, n in num_blocks.items()}
        self.requests: dict[str, RequestBlocks] = {}
        self.stats = PrefixCacheStats()

    # ---- helpers -------------------------------------------------------------------------
    def window_start_block(self, kind: str, position: int) -> int:
        return window_start_block(kind, position, self.sliding_window, self.block_size)

    def _block_keys(self, request: Request, blocks: RequestBlocks, num_tokens: int) -> int:
        """Extend `blocks.keys` over the request's full blocks within its first `num_tokens`
        tokens; returns how many full blocks that is (the keys may already go further)."""
        keys = blocks.keys
        for index in range(len(keys), num_tokens // self.block_size):
            parent = hash(keys[-1]) if keys else None
            start, end = index * self.block_size, (index + 1) * self.block_size
            chunk = tuple(request.token_ids(start, end))
            media = block_media_hashes(request.media, start, end) if request.media else ()
            # Media tokens are the same placeholder ids for any content: their items'
            # content hashes join the key, so only the same media share a block.
            keys.append((parent, chunk, media) if media else (parent, chunk))
        return num_tokens // self.block_size

    def _state(self, request: Request) -> RequestBlocks:
        if request.request_id not in self.requests:
            self.requests[request.request_id] = RequestBlocks(
                tables={kind: [] for kind in self.pools},
                num_registered={kind: 0 for kind in self.pools})
        return self.requests[request.request_id]

    # ---- admission -----------------------------------------------------------------------
    def find_cached_prefix(self, request: Request) -> int:
        """Number of leading tokens whose KV the prefix cache can supply (block multiple)."""
        if not self.enable_prefix_caching or request.wants_prompt_logprobs:
            return 0
        state = self._state(request)
        # Global layers: the longest run of cached blocks from the start.
        longest = self._block_keys(request, state, request.num_tokens - 1)
        keys = state.keys
        for kind, pool in self.pools.items():
            if kind == SLIDING:
                continue
            hits = 0
            while hits < longest and pool.lookup(keys[hits]) is not None:
                hits += 1
            longest = hits
        # Sliding layers: shrink until the window before the reuse point is cached.
        if SLIDING in self.pools:
            pool = self.pools[SLIDING]
            while longest > 0:
                start = self.window_start_block(SLIDING, longest * self.block_size)
                if all(pool.lookup(keys[b]) is not None for b in range(start, longest)):
                    break
                longest -= 1
        return longest * self.block_size

    def allocate(self, request: Request, num_new_tokens: int, num_cached_tokens: int = 0) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed (and cached) ones.

        Returns False, changing nothing, when a pool has too few free blocks.
        """
        state = self._state(request)
        first_position = request.num_computed_tokens + num_cached_tokens
        total = first_position + num_new_tokens
        num_cached_blocks = num_cached_tokens // self.block_size
        keys = state.keys
        plan: dict[str, tuple[list[int], int]] = {}
        for kind, pool in self.pools.items():
            table = state.tables[kind]
            reuse: list[int] = []
            if num_cached_blocks:
                start = self.window_start_block(kind, first_position)
                reuse = [NULL_BLOCK] * start + [pool.lookup(keys[b])
                                                for b in range(start, num_cached_blocks)]
            needed = -(-total // self.block_size) - len(table) - len(reuse)
            # Reviving cached blocks that sit in the free list also consumes free blocks.
            revived = sum(1 for b in reuse if b != NULL_BLOCK and pool.ref_counts[b] == 0)
            if needed + revived > pool.num_free:
                return False
            plan[kind] = (reuse, needed)
        for kind, (reuse, needed) in plan.items():
            pool, table = self.pools[kind], state.tables[kind]
            for block in reuse:
                if block != NULL_BLOCK:
                    pool.acquire(block)
            table.extend(reuse)
            table.extend(pool.allocate() for _ in range(max(needed, 0)))
            if num_cached_blocks:
                state.num_registered[kind] = num_cached_blocks
        return True

    def record_cache_query(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        self.stats.queries += num_prompt_tokens
        self.stats.hits += num_cached_tokens

    # ---- after a step --------------------------------------------------------------------
    def on_computed(self, request: Request) -> None:
        """Register newly full blocks in the prefix cache and drop blocks out of the window."""
        state = self.requests.get(request.request_id)
        if state is None:
            return
        computed = request.num_computed_tokens
        full = self._block_keys(request, state, computed) if self.enable_prefix_caching else 0
        for kind, pool in self.pools.items():
            table = state.tables[kind]
            if self.enable_prefix_caching:
                for index in range(state.num_registered[kind], full):
                    if table[index] != NULL_BLOCK:
                        pool.register(table[index], state.keys[index])
                state.num_registered[kind] = full
            # Blocks before the window start are null up to where the last release stopped,
            # so only the newly passed ones are visited (oldest first, as they left the window).
            end = self.window_start_block(kind, computed)
            start = end
            while start > 0 and table[start - 1] != NULL_BLOCK:
                start -= 1
            for index in range(start, end):
                pool.release(table[index])
                table[index] = NULL_BLOCK

    def free(self, request: Request) -> None:
        """Give back every block; cached ones stay reusable until evicted."""
        state = self.requests.pop(request.request_id, None)
        if state is None:
            return
        for kind, table in state.tables.items():
            # Tail blocks first, so the prefix's head (most shareable) is evicted last.
            for block in reversed(table):
                self.pools[kind].release(block)

    def fork(self, parent: Request, child: Request, num_tokens: int) -> int:
        """Let `child` share the parent's KV for up to its first `num_tokens` tokens.

        Returns how many tokens are shared: a block multiple, shrunk where the parent's sliding
        layers already dropped blocks the child would still need.
        """
        source = self.requests[parent.request_id]
        num_blocks = num_tokens // self.block_size
        if SLIDING in source.tables:
            table = source.tables[SLIDING]
            while num_blocks > 0 and NULL_BLOCK in table[
                    self.window_start_block(SLIDING, num_blocks * self.block_size):num_blocks]:
                num_blocks -= 1
        state = self._state(child)
        for kind, pool in self.pools.items():
            start = self.window_start_block(kind, num_blocks * self.block_size)
            shared = [NULL_BLOCK] * start + source.tables[kind][start:num_blocks]
            for block in shared:
                if block != NULL_BLOCK:
                    pool.acquire(block)
            state.tables[kind] = shared
            state.num_registered[kind] = num_blocks
        state.keys = list(source.keys[:num_blocks])
        return num_blocks * self.block_size

    def block_tables(self, request: Request) -> dict[str, list[int]]:
        return self.requests[request.request_id].tables

    def num_held_blocks(self, request: Request, kind: str) -> int:
        state = self.requests.get(request.request_id)
        return 0 if state is None else sum(1 for b in state.tables[kind] if b != NULL_BLOCK)

    def usage(self) -> float:
        """Fraction of blocks held by requests (cached but unreferenced blocks count as free)."""
        used = sum(pool.num_used for pool in self.pools.values())
        total = sum(pool.num_blocks - 1 for pool in self.pools.values())
        return used / total
