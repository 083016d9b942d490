"""A worker rank's lower KV tiers: host-memory slots for its share of the K/V, and its files
in the disk tier's directory; `apply` makes a step's `KVTransfers` (see there for the order).

A slot of kind k holds one block of every layer of kind k this rank keeps, K and V:
[slots, layers of k, 2, block_size, kv_heads, head_dim]. On a GPU the slots are pinned, so
the copy engines move blocks straight between them and the device without a host-side
copy, on two streams of their own (one per direction, so saves and loads move at once):

- saves: the blocks' rows are gathered into one device buffer on the compute stream, in
  one launch over all layers (`muse.kernels.kv_blocks`), so the forward pass may then
  overwrite the blocks (write-back reuses them); the save stream moves the buffer into the
  slots, one copy per run of consecutive slots, while the forward pass runs: saves never
  hold up a step. The save stream first waits for the loads queued
  before (a slot being reused may still be read);
- loads: the load stream moves the slots into a device buffer, after the saves still
  writing any of those slots (an event per save), and the compute stream waits for it, then
  scatters the buffer into the blocks ahead of the forward pass (one launch too).

The host reads slots only to write disk files: it waits for the save stream first. A file
holds a slot's bytes as they are in memory.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from muse.engine.kv_offload import disk_file
from muse.engine.kv_transfers import KVTransfers
from muse.kernels.kv_blocks import KVBlocks


class HostKVStore:
    def __init__(self, layer_types: list[str], kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 host_blocks: dict[str, int], disk_root: Path | None = None,
                 shard: str = "") -> None:
        self.layers = layers_by_kind(layer_types, host_blocks)
        self.blocks = {kind: KVBlocks(kv_caches, layers) for kind, layers in self.layers.items()}
        cache = kv_caches[0][0]
        self.device = cache.device
        on_gpu = cache.is_cuda
        self.slots = {kind: torch.empty((n, len(self.layers[kind]), 2, *cache.shape[1:]),
                                        dtype=cache.dtype)
                      for kind, n in host_blocks.items()}
        self.save_stream = self.load_stream = None
        # (kind, slot) -> the event after the last save into it, while it may be running.
        self.saving: dict[tuple[str, int], torch.cuda.Event] = {}
        self.forget_at = 1024
        if on_gpu:
            self.save_stream = torch.cuda.Stream(self.device)
            self.load_stream = torch.cuda.Stream(self.device)
            pin(list(self.slots.values()), self)
        self.disk_root = disk_root
        self.shard = shard

    @torch.inference_mode()
    def apply(self, transfers: KVTransfers) -> None:
        if transfers.disk_saves and self.save_stream is not None:
            self.save_stream.synchronize()  # the slots' bytes have landed
        for kind, slot, key_hex in transfers.disk_saves:
            self._write(kind, slot, key_hex)
        for kind, (blocks, slots) in _by_kind(transfers.saves).items():
            self._save(kind, blocks, slots)
        for kind, (slots, blocks) in _by_kind(transfers.loads).items():
            self._load(kind, slots, blocks)
        for kind, key_hex, block in transfers.disk_loads:
            self._put(kind, [block], self._read(kind, key_hex).unsqueeze(0).to(self.device))
        for kind, key_hex in transfers.disk_drops:
            self._path(kind, key_hex).unlink(missing_ok=True)

    def _save(self, kind: str, blocks: list[int], slots: list[int]) -> None:
        if not self.layers[kind]:
            return
        order = sorted(range(len(slots)), key=slots.__getitem__)
        rows = self.blocks[kind].gather([blocks[i] for i in order])
        stream = self.save_stream
        if stream is not None:  # after the gather, and after loads that read the slots
            stream.wait_stream(torch.cuda.current_stream(self.device))
            stream.wait_stream(self.load_stream)
            rows.record_stream(stream)
        with self._on(stream):
            for first, start, count in _runs([slots[i] for i in order]):
                self.slots[kind][start:start + count].copy_(rows[first:first + count],
                                                            non_blocking=True)
        if stream is not None:
            done = stream.record_event()
            self._forget_landed_saves()
            self.saving.update(((kind, slot), done) for slot in slots)

    def _load(self, kind: str, slots: list[int], blocks: list[int]) -> None:
        if not self.layers[kind]:
            return
        order = sorted(range(len(slots)), key=slots.__getitem__)
        host = self.slots[kind]
        stream = self.load_stream
        # Allocated on the load stream, which need not wait for the compute stream's queue.
        with self._on(stream):
            rows = torch.empty((len(slots), *host.shape[1:]), dtype=host.dtype,
                               device=self.device)
            if stream is not None:  # after the saves still writing these slots
                for event in {id(e): e for e in (self.saving.get((kind, slot))
                                                 for slot in slots) if e is not None}.values():
                    stream.wait_event(event)
            for first, start, count in _runs([slots[i] for i in order]):
                rows[first:first + count].copy_(host[start:start + count], non_blocking=True)
        if stream is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(stream)
            rows.record_stream(compute)
        self._put(kind, [blocks[i] for i in order], rows)

    def _forget_landed_saves(self) -> None:
        """Drop the entries of saves that have landed, once the map has doubled since the
        last time (a query per save, not per slot)."""
        if len(self.saving) < self.forget_at:
            return
        events = {id(event): event for event in self.saving.values()}
        landed = {key for key, event in events.items() if event.query()}
        self.saving = {slot: event for slot, event in self.saving.items()
                       if id(event) not in landed}
        self.forget_at = max(1024, 2 * len(self.saving))

    def _on(self, stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
        """Work issued inside runs on `stream`; None (a CPU): in place."""
        return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)

    def _put(self, kind: str, blocks: list[int], rows: torch.Tensor) -> None:
        self.blocks[kind].put(blocks, rows)

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


def pin(tensors: list[torch.Tensor], owner: object) -> None:
    """Page-lock `tensors` (host memory) for the copy engines until `owner` is collected.

    Registered in place, not allocated as pinned memory: torch's pinned allocator rounds
    each allocation up to a power of two, which for a tier of tens of GiB could double it."""
    cudart = torch.cuda.cudart()
    for tensor in tensors:
        if tensor.numel():
            error = cudart.cudaHostRegister(tensor.data_ptr(),
                                            tensor.numel() * tensor.element_size(), 0)
            if int(error) != 0:
                raise RuntimeError(f"cannot page-lock {tensor.nbytes / 2**30:.1f} GiB of host "
                                   f"memory for the KV offload tier (CUDA error "
                                   f"{int(error)}); lower --kv-offload-gb")
    # The finalizer holds the tensors, so their memory is unregistered before it is freed.
    weakref.finalize(owner, _unpin, tensors)


def _unpin(tensors: list[torch.Tensor]) -> None:
    cudart = torch.cuda.cudart()
    for tensor in tensors:
        if tensor.numel():
            cudart.cudaHostUnregister(tensor.data_ptr())


def layers_by_kind(layer_types: list[str], kinds: Iterable[str]) -> dict[str, list[int]]:
    """The positions in `layer_types` (a rank's layers, as its KV caches are ordered) of
    each kind's layers."""
    return {kind: [i for i, t in enumerate(layer_types) if t == kind] for kind in kinds}


def _runs(sorted_slots: list[int]) -> list[tuple[int, int, int]]:
    """(first position, first slot, length) of each run of consecutive slots in
    `sorted_slots`: one copy each."""
    runs: list[tuple[int, int, int]] = []
    for position, slot in enumerate(sorted_slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((position, slot, 1))
    return runs


def _by_kind(items: list[tuple[str, int, int]]) -> dict[str, tuple[list[int], list[int]]]:
    """Copies grouped by kind: the two columns of each kind's (a, b) pairs."""
    grouped: dict[str, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
    for kind, a, b in items:
        grouped[kind][0].append(a)
        grouped[kind][1].append(b)
    return grouped
