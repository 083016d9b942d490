"""Compiled grammars kept for reuse, bounded by their total size in bytes.

A large schema compiles to hundreds of MB of token-mask tables (a 30k-value enum: about
100 MB), so the cache holds at most `max_bytes` and drops the least recently used grammar
first. Dropping one frees nothing a running request needs: its matcher keeps the grammar.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class GrammarCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[Any, tuple[Any, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Any) -> bool:
        return key in self._entries

    def get(self, key: Any) -> Any | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: Any, compiled: Any) -> None:
        """Keep `compiled` (anything with `memory_size_bytes`), evicting the least recently
        used; one larger than the whole bound is not kept at all."""
        size = int(compiled.memory_size_bytes)
        if key in self._entries:
            self.num_bytes -= self._entries.pop(key)[1]
        if size > self.max_bytes:
            return
        self._entries[key] = (compiled, size)
        self.num_bytes += size
        while self.num_bytes > self.max_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.num_bytes -= evicted
