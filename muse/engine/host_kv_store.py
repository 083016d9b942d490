"""A worker rank's lower KV tiers: host-memory slots for its share of the K/V, and its files
in the disk tier's directory; `apply` makes a step's `KVTransfers` (see there for the order).

A slot of kind k holds one block of every layer of kind k this rank keeps, K and V:
[slots, layers of k, 2, block_size, kv_heads, head_dim], pinned when the KV lives on a GPU.
Copies between a GPU and pinned slots are queued on the current stream without waiting
(one per block), so they keep their place among the steps' kernels and the host runs on;
only a disk write waits for the stream, to read what the slot holds. A file holds a slot's
bytes as they are in memory.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from muse.engine.kv_offload import disk_file
from muse.engine.kv_transfers import KVTransfers


class HostKVStore:
    def __init__(self, layer_types: list[str], kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 host_blocks: dict[str, int], disk_root: Path | None = None,
                 shard: str = "") -> None:
        self.kv_caches = kv_caches
        self.layers = {kind: [i for i, t in enumerate(layer_types) if t == kind]
                       for kind in host_blocks}
        cache = kv_caches[0][0]
        self.device = cache.device
        self.slots = {kind: torch.zeros((n, len(self.layers[kind]), 2, *cache.shape[1:]),
                                        dtype=cache.dtype, pin_memory=cache.is_cuda)
                      for kind, n in host_blocks.items()}
        self.disk_root = disk_root
        self.shard = shard

    @torch.inference_mode()
    def apply(self, transfers: KVTransfers) -> None:
        if transfers.disk_saves and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # earlier saves landed
        for kind, slot, key_hex in transfers.disk_saves:
            self._write(kind, slot, key_hex)
        for kind, block, slot in transfers.saves:
            self.slots[kind][slot].copy_(self._block(kind, block), non_blocking=True)
        for kind, slot, block in transfers.loads:
            self._put(kind, block, self.slots[kind][slot].to(self.device, non_blocking=True))
        for kind, key_hex, block in transfers.disk_loads:
            self._put(kind, block, self._read(kind, key_hex).to(self.device))
        for kind, key_hex in transfers.disk_drops:
            self._path(kind, key_hex).unlink(missing_ok=True)

    def _block(self, kind: str, block: int) -> torch.Tensor:
        """GPU block `block` of every layer of `kind`: [layers, 2, block_size, heads, dim]."""
        layers = [self.kv_caches[layer] for layer in self.layers[kind]]
        if not layers:
            return self.slots[kind][0].new_empty(self.slots[kind].shape[1:])
        return torch.stack([torch.stack((k[block], v[block])) for k, v in layers])

    def _put(self, kind: str, block: int, rows: torch.Tensor) -> None:
        for position, layer in enumerate(self.layers[kind]):
            k, v = self.kv_caches[layer]
            k[block].copy_(rows[position, 0])
            v[block].copy_(rows[position, 1])

    def _path(self, kind: str, key_hex: str) -> Path:
        if self.disk_root is None:
            raise RuntimeError("a disk transfer reached a rank without a disk tier")
        return disk_file(self.disk_root, kind, key_hex, self.shard)

    def _write(self, kind: str, slot: int, key_hex: str) -> None:
        path = self._path(kind, key_hex)
        partial = path.with_suffix(".partial")
        self.slots[kind][slot].view(torch.uint8).numpy().tofile(partial)
        os.replace(partial, path)  # a reader never sees half a block

    def _read(self, kind: str, key_hex: str) -> torch.Tensor:
        shape, dtype = self.slots[kind].shape[1:], self.slots[kind].dtype
        data = torch.from_numpy(np.fromfile(self._path(kind, key_hex), dtype=np.uint8))
        return data.view(dtype).view(shape)
