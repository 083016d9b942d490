"""A worker rank's lower KV tiers: host-memory slots for its share of the K/V, and its files
in the disk tier's directory; `apply` makes a step's `KVTransfers` (see there for the order).

A slot of kind k holds one block of every layer of kind k this rank keeps, K and V:
[slots, layers of k, 2, block_size, kv_heads, head_dim]. A step's copies of one kind move in
one transfer each way, through a pinned staging buffer, with a gather or scatter per layer
on the device:

- saves: the blocks' rows gathered on the device, copied to a pinned buffer without waiting
  (queued after the kernels that wrote them), and scattered into their slots by the host
  once the copy has landed: before the next read of the slots (a load, a disk write, the
  next step's saves), which by then rarely waits;
- loads: the slots gathered by the host into a pinned buffer, copied to the device without
  waiting, and scattered into the blocks there, ahead of the step's forward pass.

A file holds a slot's bytes as they are in memory.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable
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
        self.layers = layers_by_kind(layer_types, host_blocks)
        cache = kv_caches[0][0]
        self.device = cache.device
        self.pin = cache.is_cuda
        self.slots = {kind: torch.zeros((n, len(self.layers[kind]), 2, *cache.shape[1:]),
                                        dtype=cache.dtype)
                      for kind, n in host_blocks.items()}
        self.disk_root = disk_root
        self.shard = shard
        # Saves whose device-to-host copy may still be running: (kind, slots, staging, event).
        self.landing: list[tuple[str, list[int], torch.Tensor, torch.cuda.Event | None]] = []

    @torch.inference_mode()
    def apply(self, transfers: KVTransfers) -> None:
        self._land()
        for kind, slot, key_hex in transfers.disk_saves:
            self._write(kind, slot, key_hex)
        for kind, pairs in _by_kind(transfers.saves).items():
            self._save(kind, *pairs)
        if transfers.loads:
            self._land()  # a load may read a slot this step saved
        for kind, pairs in _by_kind(transfers.loads).items():
            slots, blocks = pairs
            self._put(kind, blocks, self._staged(self.slots[kind].index_select(
                0, torch.tensor(slots)), self.device))
        for kind, key_hex, block in transfers.disk_loads:
            self._put(kind, [block], self._read(kind, key_hex).unsqueeze(0).to(self.device))
        for kind, key_hex in transfers.disk_drops:
            self._path(kind, key_hex).unlink(missing_ok=True)

    def _save(self, kind: str, blocks: list[int], slots: list[int]) -> None:
        if not self.layers[kind]:
            return
        rows = gather_blocks(self.kv_caches, self.layers[kind], blocks)
        staging = self._staged(rows, torch.device("cpu"))
        event = None
        if self.pin:
            event = torch.cuda.Event()
            event.record()
        self.landing.append((kind, slots, staging, event))

    def _land(self) -> None:
        """Scatter the saves whose copies were queued into their slots (waiting for them)."""
        for kind, slots, staging, event in self.landing:
            if event is not None:
                event.synchronize()
            self.slots[kind][slots] = staging
        self.landing.clear()

    def _staged(self, rows: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`rows` on `device`, through pinned memory and without waiting when a GPU is
        involved."""
        if not self.pin:
            return rows.to(device)
        if device.type == "cpu":
            staging = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            return staging.copy_(rows, non_blocking=True)
        return rows.pin_memory().to(device, non_blocking=True)

    def _put(self, kind: str, blocks: list[int], rows: torch.Tensor) -> None:
        put_blocks(self.kv_caches, self.layers[kind], blocks, rows)

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


def layers_by_kind(layer_types: list[str], kinds: Iterable[str]) -> dict[str, list[int]]:
    """The positions in `layer_types` (a rank's layers, as its KV caches are ordered) of
    each kind's layers."""
    return {kind: [i for i, t in enumerate(layer_types) if t == kind] for kind in kinds}


def gather_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], layers: list[int],
                  blocks: list[int]) -> torch.Tensor:
    """Blocks `blocks` of the layers `layers` (of one kind), on their device:
    [blocks, layers, 2 (K, V), block_size, kv_heads, head_dim]."""
    index = torch.tensor(blocks, device=kv_caches[0][0].device)
    return torch.stack([torch.stack((k.index_select(0, index), v.index_select(0, index)),
                                    dim=1) for k, v in (kv_caches[i] for i in layers)], dim=1)


def put_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], layers: list[int],
               blocks: list[int], rows: torch.Tensor) -> None:
    """Write rows [blocks, layers, 2, ...] (on the caches' device) into `blocks`."""
    index = torch.tensor(blocks, device=kv_caches[0][0].device)
    for position, layer in enumerate(layers):
        k, v = kv_caches[layer]
        k.index_copy_(0, index, rows[:, position, 0])
        v.index_copy_(0, index, rows[:, position, 1])


def _by_kind(items: list[tuple[str, int, int]]) -> dict[str, tuple[list[int], list[int]]]:
    """Copies grouped by kind: the two columns of each kind's (a, b) pairs."""
    grouped: dict[str, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
    for kind, a, b in items:
        grouped[kind][0].append(a)
        grouped[kind][1].append(b)
    return grouped
