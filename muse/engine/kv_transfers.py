"""The KV block copies a step makes between tiers before its forward pass.

The scheduler side (`kv_offload.KVOffload`) plans them; every worker rank makes them on its
own shard of the KV (`host_kv_store.HostKVStore`), in this order, so each copy reads what
the ones before it left:

1. `disk_saves`: host slots whose prefix leaves host memory, written to files;
2. `saves`: GPU blocks written to host slots (written through when computed, or written
   back as the GPU pool reuses them);
3. `loads`: host slots read into freshly allocated GPU blocks (a prefix hit in host memory);
4. `disk_loads`: files read into freshly allocated GPU blocks (a prefix hit on disk);
5. `disk_drops`: files deleted (the disk tier's least recently used prefixes).

Then the forward pass may overwrite the GPU blocks the saves read.
"""

from __future__ import annotations

from dataclasses import dataclass, field


# A dataclass (msgspec encodes it inside the step message), so the engine needs no msgspec
# with one rank.
@dataclass
class KVTransfers:
    disk_saves: list[tuple[str, int, str]] = field(default_factory=list)  # (kind, slot, key)
    saves: list[tuple[str, int, int]] = field(default_factory=list)  # (kind, block, slot)
    loads: list[tuple[str, int, int]] = field(default_factory=list)  # (kind, slot, block)
    disk_loads: list[tuple[str, str, int]] = field(default_factory=list)  # (kind, key, block)
    disk_drops: list[tuple[str, str]] = field(default_factory=list)  # (kind, key hex)

    def __bool__(self) -> bool:
        return bool(self.disk_saves or self.saves or self.disk_loads or self.loads
                    or self.disk_drops)
