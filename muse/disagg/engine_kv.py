"""The engine's KV as disaggregation reads and writes it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from muse.engine.host_kv_store import layers_by_kind
from muse.engine.kv_cache import KVCacheManager


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
