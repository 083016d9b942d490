"""The encoder-output cache: media content hash -> encoder embeddings, bounded in bytes.

An image, video or audio clip that comes back (the same picture in every turn of a chat, a
system prompt's logo in every request) is encoded once: its embeddings are kept under the
item's `content_hash` (`muse.multimodal.processor.ProcessedMedia`), and any later item with
an equal hash reuses them, across turns and requests. Equal hashes mean equal encoder inputs
after resizing and normalization, so equal outputs for the same weights; call `clear()` when
the encoder's weights change.

- `EncoderCache(max_bytes)` keeps at most `max_bytes` bytes of tensors (numel x element
  size), evicting the least recently used entries (`get` and `put` count as uses). A tensor
  larger than the whole budget is not stored. A tensor that is a view into a larger storage
  (the encoders return `split`s of one packed output) is copied first, so the cache holds
  exactly the bytes it counts and does not keep the packed tensor alive.
- `pin(hash)` / `unpin(hash)` are reference counts: an entry pinned by a running request
  (its embeddings not yet scattered into the decoder's inputs) is never evicted. When the
  room cannot be made from unpinned entries, `put` evicts nothing, stores nothing and
  returns False.
- `encode_with_cache(cache, items, encode_fn)` returns the embeddings of a list of processed
  media items, calling `encode_fn` once, on the misses only (in order, each distinct hash
  once), and storing what it returns.

Metrics. vLLM has no metrics for its encoder-output cache: its `vllm:mm_cache_queries` /
`vllm:mm_cache_hits` counters count items of its multimodal *processor* cache (processed
inputs, before the encoder). This cache's counters therefore have their own names, meant for
the server's Prometheus endpoint as they appear in `stats()`:

    muse:encoder_cache_hits_total       counter  lookups served from the cache (items)
    muse:encoder_cache_misses_total     counter  lookups not in the cache (items)
    muse:encoder_cache_evictions_total  counter  entries evicted to make room
    muse:encoder_cache_usage_bytes      gauge    bytes of embeddings held now
    muse:encoder_cache_capacity_bytes   gauge    the byte budget (`max_bytes`)
    muse:encoder_cache_entries          gauge    entries held now

hits + misses is the number of queries, as vLLM's `mm_cache_queries`. Counters only grow:
`clear()` drops the entries but keeps the counts.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch

METRIC_HITS = "muse:encoder_cache_hits_total"
METRIC_MISSES = "muse:encoder_cache_misses_total"
METRIC_EVICTIONS = "muse:encoder_cache_evictions_total"
METRIC_USAGE_BYTES = "muse:encoder_cache_usage_bytes"
METRIC_CAPACITY_BYTES = "muse:encoder_cache_capacity_bytes"
METRIC_ENTRIES = "muse:encoder_cache_entries"


class HasContentHash(Protocol):
    content_hash: str


Item = TypeVar("Item", bound=HasContentHash)


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's own elements (not of the storage it may be a view into)."""
    return tensor.numel() * tensor.element_size()


class EncoderCache:
    """Content hash -> encoder output, LRU within a byte budget, with pinned entries."""

    def __init__(self, max_bytes: int) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be a non-negative integer, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()  # oldest use first
        self._pins: dict[str, int] = {}
        self._lock = threading.RLock()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, content_hash: object) -> bool:
        """Whether the hash is stored; neither a use nor a hit or miss."""
        return content_hash in self._entries

    def get(self, content_hash: str) -> torch.Tensor | None:
        """The stored output (now the most recently used), or None; counts a hit or a miss."""
        with self._lock:
            tensor = self._entries.get(content_hash)
            if tensor is None:
                self.misses += 1
                return None
            self._entries.move_to_end(content_hash)
            self.hits += 1
            return tensor

    def put(self, content_hash: str, tensor: torch.Tensor) -> bool:
        """Store an output, evicting least recently used unpinned entries until it fits.

        Returns whether it is stored. False, with nothing evicted, when the tensor is larger
        than the budget or the unpinned entries cannot make room for it. A hash already
        stored keeps its tensor (equal hashes mean equal outputs) and becomes the most
        recently used.
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"an encoder output must be a torch.Tensor, got "
                            f"{type(tensor).__name__}")
        size = tensor_nbytes(tensor)
        with self._lock:
            if content_hash in self._entries:
                self._entries.move_to_end(content_hash)
                return True
            if size > self.max_bytes:
                return False
            need = self.bytes + size - self.max_bytes
            if need > 0:
                victims, freed = [], 0
                for key, stored in self._entries.items():  # least recently used first
                    if self._pins.get(key):
                        continue
                    victims.append(key)
                    freed += tensor_nbytes(stored)
                    if freed >= need:
                        break
                if freed < need:
                    return False
                for key in victims:
                    self.bytes -= tensor_nbytes(self._entries.pop(key))
                    self.evictions += 1
            tensor = tensor.detach()
            if tensor.untyped_storage().nbytes() != size:  # a view: own exactly its bytes
                tensor = tensor.clone()
            self._entries[content_hash] = tensor
            self.bytes += size
            return True

    def _count_hit(self) -> None:
        with self._lock:
            self.hits += 1

    def pin(self, content_hash: str) -> None:
        """Keep a stored entry from eviction until as many `unpin`s (a reference count)."""
        with self._lock:
            if content_hash not in self._entries:
                raise KeyError(f"cannot pin {content_hash!r}: not in the encoder cache")
            self._pins[content_hash] = self._pins.get(content_hash, 0) + 1

    def unpin(self, content_hash: str) -> None:
        with self._lock:
            count = self._pins.get(content_hash, 0)
            if count == 0:
                raise KeyError(f"cannot unpin {content_hash!r}: it is not pinned")
            if count == 1:
                del self._pins[content_hash]
            else:
                self._pins[content_hash] = count - 1

    def pin_count(self, content_hash: str) -> int:
        return self._pins.get(content_hash, 0)

    def clear(self) -> None:
        """Drop every entry and pin (e.g. after new weights); the counters keep counting."""
        with self._lock:
            self._entries.clear()
            self._pins.clear()
            self.bytes = 0

    def stats(self) -> dict[str, int]:
        """The Prometheus summary: metric name -> value (names in the module docstring)."""
        with self._lock:
            return {METRIC_HITS: self.hits, METRIC_MISSES: self.misses,
                    METRIC_EVICTIONS: self.evictions, METRIC_USAGE_BYTES: self.bytes,
                    METRIC_CAPACITY_BYTES: self.max_bytes, METRIC_ENTRIES: len(self._entries)}


def encode_with_cache(cache: EncoderCache, items: Sequence[Item],
                      encode_fn: Callable[[list[Item]], Sequence[torch.Tensor]]
                      ) -> list[torch.Tensor]:
    """The embeddings of `items` (anything with a `content_hash`), in their order.

    Hits come from the cache. The misses go to one `encode_fn(missing_items)` call, in the
    order they come, each distinct hash once (a repeat within `items` counts as a hit: it is
    served by that one encoding); it must return one tensor per item given. Its outputs are
    stored; one the cache cannot hold (too large, or no unpinned room) is still returned.
    `encode_fn` is not called when nothing is missing.
    """
    results: list[torch.Tensor | None] = []
    missing: list[Any] = []
    pending: dict[str, list[int]] = {}  # a missing hash -> the positions waiting for it
    for position, item in enumerate(items):
        key = item.content_hash
        if key in pending:
            cache._count_hit()
            pending[key].append(position)
            results.append(None)
            continue
        tensor = cache.get(key)
        if tensor is None:
            pending[key] = [position]
            missing.append(item)
        results.append(tensor)
    if missing:
        encoded = list(encode_fn(missing))
        if len(encoded) != len(missing):
            raise ValueError(f"encode_fn returned {len(encoded)} outputs for "
                             f"{len(missing)} items")
        for item, tensor in zip(missing, encoded):
            cache.put(item.content_hash, tensor)
            for position in pending[item.content_hash]:
                results[position] = tensor
    return results  # type: ignore[return-value]


class HasSpans(Protocol):
    content_hash: str
    spans: list[tuple[int, int]]


class RequestPins:
    """The cache entries each running request pins: the items whose media tokens it has begun
    to compute and not finished. A prefill chunked across steps thus finds its item's output
    in the next step instead of encoding it again (or, with the scheduler's encoder budget,
    paying for it twice). `update` after each step's progress, `release` when the request
    finishes, is aborted or is preempted (it recomputes from the start, pinning again)."""

    def __init__(self, cache: EncoderCache) -> None:
        self.cache = cache
        self._held: dict[str, set[str]] = {}  # request id -> content hashes it pins

    def held(self, request_id: str) -> set[str]:
        return set(self._held.get(request_id, ()))

    def update(self, request_id: str, media: Sequence[HasSpans], computed: int) -> None:
        """Pin what the request is in the middle of after `computed` tokens; unpin the rest.
        An item not in the cache (too large for it) has nothing to pin."""
        wanted = {item.content_hash for item in media
                  if item.spans[0][0] < computed < item.spans[-1][0] + item.spans[-1][1]}
        held = self._held.setdefault(request_id, set())
        for key in held - wanted:
            self._unpin(key)
        held &= wanted
        for key in wanted - held:
            if key in self.cache:
                self.cache.pin(key)
                held.add(key)
        if not held:
            del self._held[request_id]

    def release(self, request_id: str) -> None:
        for key in self._held.pop(request_id, ()):
            self._unpin(key)

    def _unpin(self, key: str) -> None:
        # `clear()` drops every pin at once; the requests' records are stale then.
        if self.cache.pin_count(key):
            self.cache.unpin(key)
