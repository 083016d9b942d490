"""The engine's KV as connectors read and write it: the blocks its prefix index holds for
prefix keys (`read_blocks`), and blocks from elsewhere entered as cached ones
(`enter_blocks`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from muse.engine.host_kv_store import layers_by_kind
from muse.engine.kv_cache import KVCacheManager
from muse.engine.prefix_keys import BlockKey
from muse.kernels.kv_blocks import gather_blocks, put_blocks

# kind -> (which keys it holds, their blocks' bytes [count, block bytes], each as it is in
# memory: [layers, 2, block_size, kv_heads, head_dim] of the KV dtype)
PulledBlocks = dict[str, tuple[list[bool], torch.Tensor]]


@dataclass
class EngineKV:
    """The block manager, this rank's KV tensors (one (K, V) pair per layer), which of them
    each attention kind's layers are, and the bytes of one block of each kind."""

    kv_cache: KVCacheManager
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    layers: dict[str, list[int]]
    block_bytes: dict[str, int]

    @classmethod
    def of(cls, kv_cache: KVCacheManager, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
           layer_types: list[str], block_bytes: dict[str, int]) -> EngineKV:
        return cls(kv_cache, kv_caches, layers_by_kind(layer_types, kv_cache.groups),
                   block_bytes)


def read_blocks(kv: EngineKV, keys: list[BlockKey]) -> PulledBlocks:
    """The blocks the prefix index holds for `keys`, per kind, copied to host memory."""
    pulled: PulledBlocks = {}
    for kind, group in kv.kv_cache.groups.items():
        blocks = [group.index.lookup(key) for key in keys]
        found = [block for block in blocks if block is not None]
        data = gather_blocks(kv.kv_caches, kv.layers[kind], found).cpu() \
            if found else torch.zeros(0)
        pulled[kind] = ([block is not None for block in blocks],
                        data.contiguous().view(torch.uint8).reshape(len(found), -1))
    return pulled


def enter_blocks(kv: EngineKV, keys: list[BlockKey], pulled: PulledBlocks) -> int:
    """Put blocks from elsewhere into fresh GPU blocks and the prefix index, cached and free
    as a finished request's (keys the index holds already, or that find no free block, are
    skipped); returns how many blocks of `keys` the index now holds in its first kind."""
    kv_cache, kv_caches, layers = kv.kv_cache, kv.kv_caches, kv.layers
    cache = kv_caches[0][0]
    for kind, (present, data) in pulled.items():
        group = kv_cache.groups[kind]
        rows = data.view(cache.dtype).view(len(data), len(layers[kind]), 2, *cache.shape[1:])
        taken: list[tuple[int, int, bytes]] = []  # (row, block, key)
        row = 0
        for key, found in zip(keys, present):
            if not found:
                continue
            if group.index.lookup(key) is None and group.pool.num_free:
                taken.append((row, group.pool.allocate(), key))
            row += 1
        if taken:
            put_blocks(kv_caches, layers[kind], [b for _, b, _ in taken],
                       rows[[r for r, _, _ in taken]].to(cache.device))
        for _, block, key in taken:
            group.index.register(block, key)
            group.pool.release(block)
    first = kv_cache.groups[next(iter(kv_cache.groups))].index
    return sum(1 for key in keys if first.lookup(key) is not None)
