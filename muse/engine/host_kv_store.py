"""A worker rank's lower KV tiers: host-memory slots for its share of the K/V, and its files
in the disk tier's directory; `apply` makes a step's `KVTransfers` (see there for the order).

A rank's layers fall in `LOAD_GROUPS` groups of consecutive layers. A slot of kind k holds
one block of every layer of kind k this rank keeps, K and V, in a tensor per group:
[slots, layers of k in the group, 2, block_size, kv_heads, head_dim]. On a GPU the slots
are pinned, so the copy engines move blocks straight between them and the device without a
host-side copy, on two streams of their own (one per direction, so saves and loads move at
once):

- saves: the blocks' rows are gathered into device buffers (one per group) on the compute
  stream, in one launch over all layers (`muse.kernels.kv_blocks`), so the forward pass
  may then overwrite the blocks (write-back reuses them); the save stream moves the buffers
  into the slots, one copy per group and run of consecutive slots, while the forward pass
  runs: saves never hold up a step. The save stream first waits for the loads queued
  before (a slot being reused may still be read);
- loads: the load stream moves the slots into device buffers group by group, after the
  saves still writing any of those slots (an event per save); the forward pass calls
  `before_layer` at each of its layers, and at a group's first layer the compute stream
  waits for that group's copies and scatters them into the blocks. So the first layers
  run while the later groups are still crossing PCIe: the load overlaps the prefill of
  the new tokens. A captured graph's replay calls no hooks: `finish_loads` lands them all
  before it.

The host reads slots only to write disk files: it waits for the save stream first. A file
holds a slot's layers in order, as they are in memory.
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

# Loads from host memory land in this many groups of consecutive layers, each just before
# the forward pass reaches it: the first group's wait is a quarter of the whole load's, and
# a save or load is a copy per group and run of slots.
LOAD_GROUPS = 4


class HostKVStore:
    def __init__(self, layer_types: list[str], kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 host_blocks: dict[str, int], disk_root: Path | None = None,
                 shard: str = "", load_groups: int = LOAD_GROUPS) -> None:
        # Each kind's layers, split by the group of consecutive layers (of all kinds) they
        # belong to: (group, positions) for the groups that have some.
        self.parts = {kind: layer_groups(layer_types, kind, load_groups) for kind in host_blocks}
        # Each group's first layer (position), whose hook lands the group's loads.
        self.group_starts: dict[int, int] = {}
        for position in range(len(layer_types)):
            self.group_starts.setdefault(position * load_groups // len(layer_types), position)
        self.blocks = {kind: [KVBlocks(kv_caches, layers) for _, layers in parts]
                       for kind, parts in self.parts.items()}
        # Saves read every group of a kind in one launch.
        self.all_blocks = {kind: KVBlocks(kv_caches, [p for _, layers in parts for p in layers],
                                          groups=[len(layers) for _, layers in parts])
                           for kind, parts in self.parts.items() if parts}
        cache = kv_caches[0][0]
        self.device = cache.device
        on_gpu = cache.is_cuda
        self.slots = {kind: [torch.empty((host_blocks[kind], len(layers), 2, *cache.shape[1:]),
                                         dtype=cache.dtype) for _, layers in parts]
                      for kind, parts in self.parts.items()}
        self.save_stream = self.load_stream = None
        # (kind, slot) -> the event after the last save into it, while it may be running.
        self.saving: dict[tuple[str, int], torch.cuda.Event] = {}
        self.forget_at = 1024
        # Loads whose scatter waits for the layer group they fill: group -> (event after
        # the group's copies or None, KVBlocks, blocks, rows).
        self.pending: dict[int, list[tuple[torch.cuda.Event | None, KVBlocks, list[int],
                                           torch.Tensor]]] = defaultdict(list)
        if on_gpu:
            self.save_stream = torch.cuda.Stream(self.device)
            self.load_stream = torch.cuda.Stream(self.device)
            pin([t for parts in self.slots.values() for t in parts], self)
        self.disk_root = disk_root
        self.shard = shard

    @torch.inference_mode()
    def apply(self, transfers: KVTransfers) -> None:
        """Make a step's copies; its loads from host memory land layer group by layer group
        as the forward pass reaches them (`before_layer`), or all at once with
        `finish_loads`."""
        if transfers.disk_saves and self.save_stream is not None:
            self.save_stream.synchronize()  # the slots' bytes have landed
        for kind, slot, key_hex in transfers.disk_saves:
            self._write(kind, slot, key_hex)
        for kind, (blocks, slots) in _by_kind(transfers.saves).items():
            self._save(kind, blocks, slots)
        if transfers.loads:
            self._load(_by_kind(transfers.loads))
        for kind, key_hex, block in transfers.disk_loads:
            self._put_slot(kind, block, self._read(kind, key_hex))
        for kind, key_hex in transfers.disk_drops:
            self._path(kind, key_hex).unlink(missing_ok=True)

    def before_layer(self, position: int) -> None:
        """The forward pass is about to run this rank's layer `position`: the loads of the
        group it starts land in the blocks first (on the compute stream)."""
        if position in self.pending:
            self._scatter(position)

    def after_layer(self, position: int, kv_cache: tuple[torch.Tensor, torch.Tensor],
                    meta: object) -> None:
        """Saves are planned per step, not per layer."""

    def finish_loads(self) -> None:
        """Every pending load lands now (before a forward pass that calls no hooks, such as
        a captured graph's replay)."""
        for group in sorted(self.pending):
            self._scatter(group)

    def _scatter(self, group: int) -> None:
        compute = torch.cuda.current_stream(self.device) if self.load_stream else None
        for event, blocks, targets, rows in self.pending.pop(group):
            if compute is not None:
                compute.wait_event(event)
                rows.record_stream(compute)
            blocks.put(targets, rows)

    def _save(self, kind: str, blocks: list[int], slots: list[int]) -> None:
        if kind not in self.all_blocks:
            return  # this rank keeps no layer of the kind
        order = sorted(range(len(slots)), key=slots.__getitem__)
        runs = _runs([slots[i] for i in order])
        gathered = self.all_blocks[kind].gather_groups([blocks[i] for i in order])
        stream = self.save_stream
        if stream is not None:  # after the gathers, and after loads that read the slots
            stream.wait_stream(torch.cuda.current_stream(self.device))
            stream.wait_stream(self.load_stream)
        for rows, host in zip(gathered, self.slots[kind]):
            if stream is not None:
                rows.record_stream(stream)
            with self._on(stream):
                for first, start, count in runs:
                    host[start:start + count].copy_(rows[first:first + count],
                                                    non_blocking=True)
        if stream is not None:
            done = stream.record_event()
            self._forget_landed_saves()
            self.saving.update(((kind, slot), done) for slot in slots)

    def _load(self, loads: dict[str, tuple[list[int], list[int]]]) -> None:
        """Host slots into device rows on the load stream, group by group in layer order;
        each group's scatter into the blocks waits in `pending` for its layers."""
        stream = self.load_stream
        plans = []
        for kind, (slots, blocks) in loads.items():
            order = sorted(range(len(slots)), key=slots.__getitem__)
            plans += [(group, kind, part, [blocks[i] for i in order],
                       _runs([slots[i] for i in order]))
                      for part, (group, _) in enumerate(self.parts[kind])]
            if stream is not None:  # after the saves still writing these slots
                for event in {id(e): e for e in (self.saving.get((kind, slot))
                                                 for slot in slots) if e is not None}.values():
                    stream.wait_event(event)
        # Allocated on the load stream, which need not wait for the compute stream's queue.
        with self._on(stream):
            for group, kind, part, targets, runs in sorted(plans, key=lambda plan: plan[0]):
                host = self.slots[kind][part]
                rows = torch.empty((len(targets), *host.shape[1:]), dtype=host.dtype,
                                   device=self.device)
                for first, start, count in runs:
                    rows[first:first + count].copy_(host[start:start + count],
                                                    non_blocking=True)
                event = stream.record_event() if stream is not None else None
                self.pending[self.group_starts[group]].append(
                    (event, self.blocks[kind][part], targets, rows))

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

    def _put_slot(self, kind: str, block: int, data: list[torch.Tensor]) -> None:
        """One slot's parts (host tensors) into `block`, now."""
        for part_blocks, rows in zip(self.blocks[kind], data):
            part_blocks.put([block], rows.unsqueeze(0).to(self.device))

    def _path(self, kind: str, key_hex: str) -> Path:
        if self.disk_root is None:
            raise RuntimeError("a disk transfer reached a rank without a disk tier")
        return disk_file(self.disk_root, kind, key_hex, self.shard)

    def _write(self, kind: str, slot: int, key_hex: str) -> None:
        """A file holds the slot's layers in order, K and V each: the groups' parts one
        after the other."""
        path = self._path(kind, key_hex)
        partial = path.with_suffix(".partial")
        with open(partial, "wb") as file:
            for host in self.slots[kind]:
                host[slot].view(torch.uint8).numpy().tofile(file)
        os.replace(partial, path)  # a reader never sees half a block

    def _read(self, kind: str, key_hex: str) -> list[torch.Tensor]:
        data = torch.from_numpy(np.fromfile(self._path(kind, key_hex), dtype=np.uint8))
        parts, offset = [], 0
        for host in self.slots[kind]:
            size = host[0].numel() * host.element_size()
            parts.append(data[offset:offset + size].view(host.dtype).view(host.shape[1:]))
            offset += size
        return parts


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


def layer_groups(layer_types: list[str], kind: str, groups: int) -> list[tuple[int, list[int]]]:
    """The positions in `layer_types` (a rank's layers, as its KV caches are ordered) of
    `kind`'s layers, by the group of consecutive layers they fall in (`groups` groups of
    about equal size): (group, positions) for each group that has some."""
    by_group: dict[int, list[int]] = defaultdict(list)
    for position, layer_type in enumerate(layer_types):
        if layer_type == kind:
            by_group[position * groups // len(layer_types)].append(position)
    return sorted(by_group.items())


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
