"""Paged KV-cache bookkeeping: a group per attention kind (its block pool and prefix index),
and the admission rule of the prefix cache.

Layers of one kind (all sliding layers, or all global layers) share block ids: a request has one
block table per kind, and block `b` of a kind means slot range [b*block_size, (b+1)*block_size)
in every layer of that kind. With speculative decoding the drafter's context rows form a
third group that shares the global group's block tables (`muse/speculative/draft_kv.py`), so
it needs no bookkeeping of its own.

Prefix cache: every full block is keyed by `prefix_keys.block_key` (its parent's key, its
token ids, and the content hashes of media it holds; the first block also the request's
`cache_salt`), so a key names a whole prefix. A block whose last user leaves keeps its key
in the group's `PrefixIndex` and stays in the pool's free list (least recently freed first
out) until it is reused, so a later request with the same prefix can take it back.

When a cached prefix of `P` tokens may be reused (`P` a multiple of the block size, and at most
prompt length - 1 so at least one token is computed to give logits):
- global layers: every block of [0, P) is cached;
- sliding layers: the query at position P sees keys (P - window, P], so the blocks covering
  [max(0, P - window + 1), P) must be cached; older blocks are not needed.
The longest P that every kind accepts wins.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from muse.config import SLIDING
from muse.engine.block_pool import NULL_BLOCK, BlockPool
from muse.engine.kv_offload import KVOffload
from muse.engine.kv_transfers import KVTransfers
from muse.engine.prefix_index import PrefixIndex
from muse.engine.prefix_keys import BlockKey, block_key, first_block_extra_keys, media_extra_keys
from muse.engine.request import Request
from muse.multimodal.engine_inputs import block_media_hashes


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


class KVCacheGroup:
    """The layers of one attention kind: their block pool and its prefix index.

    `on_evict(kind, block, key)` hears of a cached prefix whose block is about to be
    overwritten (a write-back tier saves it first)."""

    def __init__(self, kind: str, num_blocks: int,
                 on_evict: Callable[[str, int, BlockKey], None] | None = None) -> None:
        self.kind = kind
        self.index = PrefixIndex()
        self.on_evict = on_evict
        self.pool = BlockPool(num_blocks, on_reuse=self._reuse)

    def _reuse(self, block: int) -> None:
        key = self.index.forget(block)
        if key is not None and self.on_evict is not None:
            self.on_evict(self.kind, block, key)


@dataclass
class RequestBlocks:
    tables: dict[str, list[int]] = field(default_factory=dict)
    keys: list[BlockKey] = field(default_factory=list)  # keys of the request's full blocks
    num_registered: dict[str, int] = field(default_factory=dict)


class KVCacheManager:
    def __init__(self, block_size: int, num_blocks: dict[str, int], sliding_window: int | None,
                 enable_prefix_caching: bool = True, offload: KVOffload | None = None) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        # Host memory and disk below the GPU pools (`--kv-offload-gb`), with prefix caching.
        self.offload = offload if enable_prefix_caching else None
        on_evict = self.offload.save if self.offload is not None \
            and self.offload.write_back else None
        self.groups = {kind: KVCacheGroup(kind, n, on_evict) for kind, n in num_blocks.items()}
        # Global layers hold every block of a prefix: their loads count the lower tiers' hits.
        self.counted_kind = next((k for k in num_blocks if k != SLIDING), next(iter(num_blocks)))
        self.requests: dict[str, RequestBlocks] = {}
        self.stats = PrefixCacheStats()
        # Blocks of finished requests kept for a decode instance to pull (disaggregation):
        # group id -> ([(kind, block)], monotonic deadline); `hold_timeout_s` from the config.
        self.holds: dict[str, tuple[list[tuple[str, int]], float]] = {}
        self.hold_timeout_s = 30.0

    @property
    def pools(self) -> dict[str, BlockPool]:
        return {kind: group.pool for kind, group in self.groups.items()}

    # ---- helpers -------------------------------------------------------------------------
    def window_start_block(self, kind: str, position: int) -> int:
        return window_start_block(kind, position, self.sliding_window, self.block_size)

    def _block_keys(self, request: Request, blocks: RequestBlocks, num_tokens: int) -> int:
        """Extend `blocks.keys` over the request's full blocks within its first `num_tokens`
        tokens; returns how many full blocks that is (the keys may already go further)."""
        keys = blocks.keys
        for index in range(len(keys), num_tokens // self.block_size):
            start, end = index * self.block_size, (index + 1) * self.block_size
            extra = first_block_extra_keys(
                request.cache_salt, request.lora.cache_id if request.lora else None) \
                if index == 0 else ()
            if request.media:
                # Media tokens are the same placeholder ids for any content: their items'
                # content hashes join the key, so only the same media share a block.
                extra += media_extra_keys(block_media_hashes(request.media, start, end))
            keys.append(block_key(keys[-1] if keys else None, request.token_ids(start, end),
                                  extra))
        return num_tokens // self.block_size

    def _cached(self, kind: str, key: BlockKey) -> bool:
        """Whether some tier holds the prefix `key` names in layers of `kind`."""
        return self.groups[kind].index.lookup(key) is not None or (
            self.offload is not None and self.offload.has(kind, key))

    def _state(self, request: Request) -> RequestBlocks:
        if request.request_id not in self.requests:
            self.requests[request.request_id] = RequestBlocks(
                tables={kind: [] for kind in self.groups},
                num_registered={kind: 0 for kind in self.groups})
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
        for kind in self.groups:
            if kind == SLIDING:
                continue
            hits = 0
            while hits < longest and self._cached(kind, keys[hits]):
                hits += 1
            longest = hits
        # Sliding layers: shrink until the window before the reuse point is cached.
        if SLIDING in self.groups:
            while longest > 0:
                start = self.window_start_block(SLIDING, longest * self.block_size)
                if all(self._cached(SLIDING, keys[b]) for b in range(start, longest)):
                    break
                longest -= 1
        return longest * self.block_size

    def allocate(self, request: Request, num_new_tokens: int, num_cached_tokens: int = 0) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed (and cached) ones.

        Cached blocks in the GPU pools are shared; those only a lower tier holds get fresh
        blocks, loaded before the step runs. Returns False, changing nothing, when a pool
        has too few free blocks.
        """
        state = self._state(request)
        first_position = request.num_computed_tokens + num_cached_tokens
        total = first_position + num_new_tokens
        if not num_cached_tokens:  # decoding: most steps fit in the blocks held already
            blocks = -(-total // self.block_size)
            if all(len(table) >= blocks for table in state.tables.values()):
                return True
        num_cached_blocks = num_cached_tokens // self.block_size
        keys = state.keys
        # Per kind: the table's cached part (a GPU block, or None: load it from below) and
        # how many fresh blocks follow it.
        plan: dict[str, tuple[list[int | None], int]] = {}
        for kind, group in self.groups.items():
            pool, table = group.pool, state.tables[kind]
            reuse: list[int | None] = []
            if num_cached_blocks:
                start = self.window_start_block(kind, first_position)
                reuse = [NULL_BLOCK] * start + [group.index.lookup(keys[b])
                                                for b in range(start, num_cached_blocks)]
            needed = -(-total // self.block_size) - len(table) - len(reuse)
            # Reviving cached blocks that sit in the free list also consumes free blocks, as
            # does every block loaded from a lower tier.
            revived = sum(1 for b in reuse if b is None or b != NULL_BLOCK
                          and pool.ref_counts[b] == 0)
            if needed + revived > pool.num_free:
                return False
            plan[kind] = (reuse, needed)
        for kind, (reuse, needed) in plan.items():
            group, table = self.groups[kind], state.tables[kind]
            for block in reuse:  # before any allocation, which could evict them
                if block is not None and block != NULL_BLOCK:
                    group.pool.acquire(block)
            for index, block in enumerate(reuse):
                if block is None:
                    reuse[index] = self._load(group, keys[index])
            table.extend(reuse)
            table.extend(group.pool.allocate() for _ in range(max(needed, 0)))
            if num_cached_blocks:
                state.num_registered[kind] = num_cached_blocks
        return True

    def _load(self, group: KVCacheGroup, key: BlockKey) -> int:
        """A fresh block that the step's transfers fill with the prefix `key` names from a
        lower tier; it joins the prefix index at once (the copy runs before any forward)."""
        block = group.pool.allocate()
        group.index.register(block, key)
        tier = self.offload.load(group.kind, key, block)
        if group.kind == self.counted_kind:  # each position once, whatever the kinds
            self.offload.stats.hit_tokens[tier] += self.block_size
        return block

    def take_transfers(self) -> KVTransfers | None:
        """The copies between tiers planned since the last step, for the next one."""
        return self.offload.take() if self.offload is not None else None

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
        for kind, group in self.groups.items():
            table = state.tables[kind]
            if self.enable_prefix_caching:
                for index in range(state.num_registered[kind], full):
                    block = table[index]
                    if block != NULL_BLOCK and group.index.register(block, state.keys[index]) \
                            and self.offload is not None and not self.offload.write_back:
                        self.offload.save(kind, block, state.keys[index])
                state.num_registered[kind] = full
            # Blocks before the window start are null up to where the last release stopped,
            # so only the newly passed ones are visited (oldest first, as they left the window).
            end = self.window_start_block(kind, computed)
            start = end
            while start > 0 and table[start - 1] != NULL_BLOCK:
                start -= 1
            for index in range(start, end):
                group.pool.release(table[index])
                table[index] = NULL_BLOCK

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, in every tier (blocks in use stay with their requests,
        unshared)."""
        for group in self.groups.values():
            group.index.clear()
        if self.offload is not None:
            self.offload.clear()

    def free(self, request: Request) -> None:
        """Give back every block; cached ones stay reusable until evicted."""
        state = self.requests.pop(request.request_id, None)
        if state is None:
            return
        if request.hold_kv_for_transfer:
            self._hold(request, state)
        for kind, table in state.tables.items():
            # Tail blocks first, so the prefix's head (most shareable) is evicted last.
            for block in reversed(table):
                self.groups[kind].pool.release(block)

    def _hold(self, request: Request, state: RequestBlocks) -> None:
        held, _ = self.holds.get(request.group_id, ([], 0.0))
        for kind, table in state.tables.items():
            for block in table:
                if block != NULL_BLOCK:
                    self.groups[kind].pool.acquire(block)
                    held.append((kind, block))
        self.holds[request.group_id] = (held, time.monotonic() + self.hold_timeout_s)

    def release_hold(self, group_id: str) -> None:
        """Let go of the blocks a finished request kept for a pull (they stay cached)."""
        held, _ = self.holds.pop(group_id, ([], 0.0))
        for kind, block in held:
            self.groups[kind].pool.release(block)

    def expire_holds(self, now: float) -> None:
        for group_id in [g for g, (_, deadline) in self.holds.items() if deadline <= now]:
            self.release_hold(group_id)

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
        for kind, group in self.groups.items():
            pool = group.pool
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
        used = sum(group.pool.num_used for group in self.groups.values())
        total = sum(group.pool.num_blocks - 1 for group in self.groups.values())
        return used / total
