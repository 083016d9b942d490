"""The encoder-output cache: LRU order, byte accounting, pinning, oversize outputs,
encode_with_cache and its counters."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from muse.multimodal.encoder_cache import (
    METRIC_EVICTIONS,
    METRIC_HITS,
    METRIC_MISSES,
    METRIC_USAGE_BYTES,
    EncoderCache,
    encode_with_cache,
)
from muse.multimodal.processor import content_hash


def emb(nbytes: int, dtype: torch.dtype = torch.float32, fill: float = 0.0) -> torch.Tensor:
    size = torch.empty((), dtype=dtype).element_size()
    assert nbytes % size == 0
    return torch.full((nbytes // size,), fill, dtype=dtype)


@dataclass
class Item:
    content_hash: str
    value: float = 0.0


class FakeEncoder:
    """Records each call's hashes; item -> [2] tensor filled with its value."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, items: list[Item]) -> list[torch.Tensor]:
        self.calls.append([item.content_hash for item in items])
        return [torch.full((2,), item.value) for item in items]


def test_lru_order_evicts_least_recently_used():
    cache = EncoderCache(max_bytes=300)
    for key in "abc":
        assert cache.put(key, emb(100))
    assert cache.get("a") is not None  # a is now the most recent: b is the oldest
    assert cache.put("d", emb(100))
    assert "b" not in cache and all(key in cache for key in "acd")
    assert cache.evictions == 1
    assert cache.put("c", emb(100))  # already there: touched, not replaced
    assert cache.put("e", emb(100))  # a is now the oldest
    assert "a" not in cache and "c" in cache and "d" in cache and "e" in cache
    assert cache.evictions == 2 and len(cache) == 3


def test_byte_accounting_across_dtypes_and_sizes():
    cache = EncoderCache(max_bytes=1000)
    tensors = {"f32": torch.zeros(10, 4, dtype=torch.float32),  # 160
               "bf16": torch.zeros(3, 7, dtype=torch.bfloat16),  # 42
               "f16": torch.zeros(50, dtype=torch.float16),  # 100
               "f64": torch.zeros(2, 3, dtype=torch.float64),  # 48
               "i8": torch.zeros(17, dtype=torch.int8)}  # 17
    total = 0
    for key, tensor in tensors.items():
        assert cache.put(key, tensor)
        total += tensor.numel() * tensor.element_size()
        assert cache.bytes == total
    assert total == 367 and len(cache) == 5
    # 700 more bytes need 67 freed: f32 (160) is the oldest and goes alone.
    assert cache.put("big", emb(700, torch.bfloat16))
    assert "f32" not in cache and cache.bytes == 367 - 160 + 700 and cache.evictions == 1
    # Evicting several: 1000 - 907 = 93 free, 400 needs 307: bf16, f16, f64, i8 (207)
    # are not enough, so big (700) goes too, oldest first, stopping once enough is freed.
    assert cache.put("next", emb(400))
    assert not any(key in cache for key in ("bf16", "f16", "f64", "i8", "big"))
    assert cache.bytes == 400 and len(cache) == 1
    assert cache.stats()[METRIC_USAGE_BYTES] == 400
    cache.clear()
    assert cache.bytes == 0 and len(cache) == 0 and cache.get("next") is None


def test_a_view_is_stored_as_its_own_bytes():
    packed = torch.randn(100, 8)
    parts = packed.split([30, 70])
    cache = EncoderCache(max_bytes=10_000)
    assert cache.put("x", parts[0])
    stored = cache.get("x")
    assert cache.bytes == 30 * 8 * 4
    assert stored.untyped_storage().nbytes() == 30 * 8 * 4
    assert torch.equal(stored, parts[0])


def test_oversize_is_refused_and_evicts_nothing():
    cache = EncoderCache(max_bytes=256)
    assert cache.put("a", emb(200))
    assert cache.put("huge", emb(260)) is False
    assert "huge" not in cache and "a" in cache and cache.bytes == 200
    assert cache.evictions == 0
    assert cache.put("exact", emb(256))  # exactly the budget fits, after evicting a
    assert cache.bytes == 256 and "a" not in cache
    assert EncoderCache(0).put("z", emb(4)) is False


def test_pinned_entries_are_not_evicted():
    cache = EncoderCache(max_bytes=300)
    for key in "abc":
        cache.put(key, emb(100))
    cache.pin("a")
    cache.pin("a")  # two requests use a
    assert cache.put("d", emb(100))  # a is oldest but pinned: b goes
    assert "a" in cache and "b" not in cache
    cache.pin("c")
    cache.pin("d")
    assert cache.put("e", emb(100)) is False  # everything is pinned
    assert len(cache) == 3 and cache.bytes == 300 and cache.evictions == 1
    cache.unpin("a")
    assert cache.pin_count("a") == 1
    assert cache.put("e", emb(100)) is False  # still pinned once
    cache.unpin("a")
    assert cache.put("e", emb(100)) and "a" not in cache
    # Room that unpinned entries cannot make is not made at all.
    cache.unpin("c")
    assert cache.put("f", emb(252)) is False
    assert "c" in cache and "e" in cache and cache.bytes == 300
    with pytest.raises(KeyError):
        cache.pin("missing")
    with pytest.raises(KeyError):
        cache.unpin("c")


def test_get_counts_hits_and_misses():
    cache = EncoderCache(max_bytes=100)
    assert cache.get("a") is None
    cache.put("a", emb(8))
    assert torch.equal(cache.get("a"), emb(8))
    assert (cache.hits, cache.misses) == (1, 1)
    stats = cache.stats()
    assert stats[METRIC_HITS] == 1 and stats[METRIC_MISSES] == 1
    assert stats[METRIC_EVICTIONS] == 0
    assert all(name.startswith("muse:encoder_cache_") for name in stats)


def test_encode_with_cache_encodes_only_misses_in_order():
    cache = EncoderCache(max_bytes=1 << 20)
    encoder = FakeEncoder()
    cache.put("b", torch.full((2,), 20.0))
    items = [Item("a", 1.0), Item("b", 2.0), Item("c", 3.0), Item("a", 1.0), Item("d", 4.0)]
    out = encode_with_cache(cache, items, encoder)
    assert encoder.calls == [["a", "c", "d"]]  # one call, misses only, each hash once
    assert [t[0].item() for t in out] == [1.0, 20.0, 3.0, 1.0, 4.0]
    assert cache.misses == 3 and cache.hits == 2  # b from the cache, the second a reused
    assert len(cache) == 4
    # Everything cached: no call at all.
    out = encode_with_cache(cache, items[::-1], encoder)
    assert len(encoder.calls) == 1
    assert [t[0].item() for t in out] == [4.0, 1.0, 3.0, 20.0, 1.0]
    assert encode_with_cache(cache, [], encoder) == [] and len(encoder.calls) == 1


def test_encode_with_cache_returns_outputs_it_cannot_store():
    cache = EncoderCache(max_bytes=4)  # one float32 at most
    out = encode_with_cache(cache, [Item("a", 5.0)], FakeEncoder())  # [2] float32: 8 bytes
    assert torch.equal(out[0], torch.full((2,), 5.0)) and len(cache) == 0

    def wrong(items):
        return []

    with pytest.raises(ValueError, match="0 outputs for 1 items"):
        encode_with_cache(EncoderCache(100), [Item("x")], wrong)


def test_equal_content_hits_across_requests():
    """Two requests (turns) with the same image: the second encodes nothing."""
    cache = EncoderCache(max_bytes=1 << 20)
    image = torch.rand(3, 28, 28)

    def encode(items):
        encode.calls += 1
        return [item.data.mean(0).flatten()[:4].clone() for item in items]

    encode.calls = 0

    @dataclass
    class Media:
        data: torch.Tensor
        content_hash: str

    def media(data):
        return Media(data, content_hash("image", data))

    first = [media(image)]
    second = [media(torch.rand(3, 28, 28)), media(image.clone())]  # a new image, then the same
    out1 = encode_with_cache(cache, first, encode)
    out2 = encode_with_cache(cache, second, encode)
    assert encode.calls == 2 and cache.hits == 1 and cache.misses == 2
    assert torch.equal(out1[0], out2[1])
    assert content_hash("audio", image) != first[0].content_hash  # kind is in the hash
