"""The KV cache's lower tiers, scheduler side: which prefixes host memory (and a disk
directory) hold, and the copies that move blocks between the tiers.

The GPU pools stay the only place a step reads K/V from. Below them:

- **host**: a fixed number of slots per attention kind in pinned host memory on every
  worker rank (`--kv-offload-gb`, alias `--hicache-size`), least recently used out. Full
  blocks reach it as soon as they are computed (`write_through`, the default) or when the
  GPU pool hands their block out again (`write_back`: fewer copies, but a prefix evicted
  from the GPU in a burst is saved in that step), see `--kv-offload-write-policy`;
- **disk** (`--kv-offload-disk DIR`): a host slot's prefix that leaves host memory is
  written to a file named by its key, kept across restarts (keys are the same in every
  process, `prefix_keys`) within `--kv-offload-disk-gb`, least recently used out.

A prefix found below the GPU is loaded back into freshly allocated GPU blocks before the
step that admits its request runs (`KVTransfers.loads`), and its blocks join the GPU prefix
index at once, so requests admitted in the same step share them. Copies planned while
scheduling a step travel with it (`take`); slots they touch are pinned until then.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from muse.engine.kv_transfers import KVTransfers
from muse.engine.prefix_keys import BlockKey

WRITE_POLICIES = ("write_through", "write_back")
HOST, DISK = "host", "disk"


def disk_file(root: Path, kind: str, key_hex: str, shard: str) -> Path:
    """Where rank `shard` (`pp<stage>-tp<rank>`) keeps its part of a block's K/V."""
    return root / kind / f"{key_hex}.{shard}.kv"


@dataclass
class TierStats:
    hit_tokens: dict[str, int] = field(default_factory=lambda: {HOST: 0, DISK: 0})


class SlotTier:
    """Keys held in a fixed number of slots, least recently used first."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.entries: OrderedDict[BlockKey, int] = OrderedDict()
        self.free = list(range(num_slots))
        self.pinned: set[int] = set()

    def lookup(self, key: BlockKey) -> int | None:
        slot = self.entries.get(key)
        if slot is not None:
            self.entries.move_to_end(key)
        return slot

    def reserve(self, key: BlockKey) -> tuple[int, BlockKey | None] | None:
        """A slot for `key`, and the key it evicted (None: it was free); None when every
        slot is pinned by this step's copies."""
        evicted = None
        if self.free:
            slot = self.free.pop()
        else:
            evicted = next((k for k, s in self.entries.items() if s not in self.pinned), None)
            if evicted is None:
                return None
            slot = self.entries.pop(evicted)
        self.entries[key] = slot
        self.pinned.add(slot)
        return slot, evicted

    def unpin(self) -> None:
        self.pinned.clear()
        if len(self.free) + len(self.entries) < self.num_slots:  # after `clear`
            held = set(self.entries.values())
            self.free = [slot for slot in range(self.num_slots) if slot not in held]

    def clear(self) -> None:
        """Forget every key; slots a pending copy uses are freed once it is taken."""
        self.entries.clear()
        self.free = [slot for slot in range(self.num_slots) if slot not in self.pinned]


class DiskIndex:
    """The keys with files in `root`, least recently used first, within `capacity_bytes`
    (each key's files hold `block_bytes[kind]` over all ranks). Files found at start-up
    are known again, oldest first."""

    def __init__(self, root: Path, block_bytes: dict[str, int], capacity_bytes: int) -> None:
        self.root = root
        self.block_bytes = block_bytes
        self.capacity_bytes = capacity_bytes
        found = []
        for kind in block_bytes:
            (root / kind).mkdir(parents=True, exist_ok=True)
            found += [(path.stat().st_mtime, kind, bytes.fromhex(path.name.split(".")[0]))
                      for path in (root / kind).glob(f"*.{shard_name(0, 0)}.kv")]
        self.entries: OrderedDict[tuple[str, BlockKey], None] = OrderedDict(
            ((kind, key), None) for _, kind, key in sorted(found))
        self.used_bytes = sum(block_bytes[kind] for kind, _ in self.entries)

    def contains(self, kind: str, key: BlockKey) -> bool:
        return (kind, key) in self.entries

    def touch(self, kind: str, key: BlockKey) -> None:
        self.entries.move_to_end((kind, key))

    def add(self, kind: str, key: BlockKey) -> list[tuple[str, BlockKey]]:
        """Record `key`'s files; returns the (kind, key)s whose files must go to stay within
        capacity, least recently used first."""
        self.entries[(kind, key)] = None
        self.used_bytes += self.block_bytes[kind]
        dropped = []
        while self.used_bytes > self.capacity_bytes and self.entries:
            (old_kind, old), _ = self.entries.popitem(last=False)
            self.used_bytes -= self.block_bytes[old_kind]
            dropped.append((old_kind, old))
        return dropped

    def clear(self) -> list[tuple[str, BlockKey]]:
        dropped = list(self.entries)
        self.entries.clear()
        self.used_bytes = 0
        return dropped


def disk_tier_root(args: Any, kv_dtype: Any) -> Path:
    """The folder of `args.kv_offload_disk` for this model's K/V: a name drawn from what
    makes blocks differ (the weights, the KV dtype and block size, the ranks' split), so a
    restarted engine reuses its own files and never another model's."""
    from muse.presets import PRESETS

    if args.model in PRESETS:
        weights: Any = {"preset": args.model, "seed": args.seed, "init_std": args.init_std}
    else:
        folder = Path(args.model).resolve()
        weights = {"checkpoint": str(folder), "files": sorted(
            (path.name, path.stat().st_size, path.stat().st_mtime_ns)
            for path in folder.iterdir() if path.suffix in (".json", ".safetensors"))}
    identity = {"weights": weights, "kv_dtype": str(kv_dtype), "block_size": args.block_size,
                "quantization": args.quantization, "tp": args.tensor_parallel_size,
                "pp": args.pipeline_parallel_size}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    return Path(args.kv_offload_disk) / digest[:16]


def shard_name(pipeline_rank: int, tensor_rank: int) -> str:
    """The part of the K/V one rank holds: data-parallel replicas and context-parallel
    ranks hold the same K/V, so they share files."""
    return f"pp{pipeline_rank}-tp{tensor_rank}"


class KVOffload:
    def __init__(self, host_blocks: dict[str, int], block_bytes: dict[str, int],
                 write_policy: str = "write_through", disk: DiskIndex | None = None) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"the KV offload write policy must be one of {WRITE_POLICIES}, "
                             f"got {write_policy!r}")
        self.host = {kind: SlotTier(n) for kind, n in host_blocks.items()}
        self.block_bytes = block_bytes
        self.write_back = write_policy == "write_back"
        self.disk = disk
        self.pending = KVTransfers()
        self.stats = TierStats()

    def has(self, kind: str, key: BlockKey) -> bool:
        return key in self.host[kind].entries or (
            self.disk is not None and self.disk.contains(kind, key))

    def _store(self, kind: str, key: BlockKey) -> int | None:
        """A host slot for `key`; the prefix it evicts goes to disk if there is one."""
        reserved = self.host[kind].reserve(key)
        if reserved is None:
            return None
        slot, evicted = reserved
        disk = self.disk
        if evicted is not None and disk is not None:
            if disk.contains(kind, evicted):
                disk.touch(kind, evicted)
            else:
                self.pending.disk_saves.append((kind, slot, evicted.hex()))
                self.pending.disk_drops += [(k, old.hex()) for k, old in disk.add(kind, evicted)]
        return slot

    def save(self, kind: str, block: int, key: BlockKey) -> None:
        """Copy GPU `block`, which holds the prefix `key` names, to host memory."""
        if self.host[kind].lookup(key) is not None:
            return
        slot = self._store(kind, key)
        if slot is not None:
            self.pending.saves.append((kind, block, slot))

    def load(self, kind: str, key: BlockKey, block: int) -> str:
        """Copy the prefix `key` names into GPU `block`, from host memory or else from
        disk; returns the tier it came from."""
        slot = self.host[kind].lookup(key)
        if slot is None:
            self.disk.touch(kind, key)
            self.pending.disk_loads.append((kind, key.hex(), block))
            return DISK
        self.host[kind].pinned.add(slot)
        self.pending.loads.append((kind, slot, block))
        return HOST

    def take(self) -> KVTransfers | None:
        """The copies planned since the last call, for the step about to run."""
        transfers, self.pending = self.pending, KVTransfers()
        for tier in self.host.values():
            tier.unpin()
        return transfers or None

    def clear(self) -> None:
        """Forget every prefix below the GPU (pending copies still run: admitted requests
        may read what they load)."""
        for tier in self.host.values():
            tier.clear()
        if self.disk is not None:
            self.pending.disk_drops += [(kind, key.hex()) for kind, key in self.disk.clear()]

    def used_bytes(self) -> dict[str, int]:
        host = sum(len(tier.entries) * self.block_bytes[kind] for kind, tier in self.host.items())
        return {HOST: host, DISK: self.disk.used_bytes if self.disk is not None else 0}

    def capacity_bytes(self) -> dict[str, int]:
        host = sum(tier.num_slots * self.block_bytes[kind] for kind, tier in self.host.items())
        return {HOST: host, DISK: self.disk.capacity_bytes if self.disk is not None else 0}


def host_blocks(budget_bytes: int, gpu_blocks: dict[str, int], block_bytes: dict[str, int]
                ) -> dict[str, int]:
    """Host slots per kind out of `budget_bytes`, in the GPU pools' proportions."""
    per_set = sum(gpu_blocks[kind] * block_bytes[kind] for kind in gpu_blocks)
    return {kind: budget_bytes * n // per_set for kind, n in gpu_blocks.items()}
