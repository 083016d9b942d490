"""The FP8 KV cache in the kernels: the store quantizes as `fp8(x / scale)` (saturating), the
Triton store and attention kernels equal their torch twins on FP8 caches, and the twin equals
plain attention over the dequantized cache.

Scales are per kv head ([kv_heads], a per-tensor scale repeats one value); tests use
different values per head so a head reading another's scale fails.
"""

from __future__ import annotations

import pytest
import torch

from muse.kernels.paged_attention import (FP8_KV_DTYPE, dequantize_kv, paged_attention,
                                          quantize_kv, write_kv)
from tests.conftest import DEVICE
from tests.kernels.test_paged_attention_triton import BATCHES, TOLERANCE, make_batch

pytest.importorskip("triton")
from muse.kernels.kv_write import write_kv_triton  # noqa: E402
from muse.kernels.paged_attention_triton import (_decode, _prefill,  # noqa: E402
                                                 paged_attention_triton)

K_SCALES = (0.02, 0.035, 0.01, 0.05)  # per kv head; amax of randn / 448 is about 0.01
V_SCALES = (0.015, 0.005, 0.04, 0.025)


def scales(kv_heads: int, device: str = DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor(K_SCALES[:kv_heads], device=device),
            torch.tensor(V_SCALES[:kv_heads], device=device))


def fp8_batch(requests, *, window, kv_heads=2, group=2, head_dim=32, dtype=torch.float32,
              block_size=16, device=DEVICE):
    """make_batch's random q and metadata, with its caches quantized to FP8."""
    q, k_cache, v_cache, meta, kind = make_batch(
        requests, block_size=block_size, window=window, kv_heads=kv_heads, group=group,
        head_dim=head_dim, dtype=dtype, device=device)
    k_scale, v_scale = scales(kv_heads, device)
    k_fp8 = quantize_kv(k_cache.flatten(0, 1), k_scale).view(k_cache.shape)
    v_fp8 = quantize_kv(v_cache.flatten(0, 1), v_scale).view(v_cache.shape)
    return q, k_fp8, v_fp8, meta, kind, k_scale, v_scale


def bits(cache: torch.Tensor) -> torch.Tensor:
    return cache.cpu().view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_is_fp8_of_the_value_over_its_head_scale(dtype):
    gen = torch.Generator().manual_seed(0)
    blocks, block_size, kv_heads, head_dim, tokens = 5, 16, 2, 16, 20
    k = (torch.randn(tokens, kv_heads, head_dim, generator=gen) * 3).to(dtype)
    # Within 448 x the smallest V scale (2.24), so only the two K values below saturate.
    v = (torch.randn(tokens, kv_heads, head_dim, generator=gen) * 0.5).to(dtype)
    k[0, 0, 0], k[1, 1, 1] = 1e4, -1e4  # beyond 448 x scale: saturate, not NaN
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    k_scale, v_scale = scales(kv_heads, "cpu")
    caches = [torch.zeros(blocks, block_size, kv_heads, head_dim, dtype=FP8_KV_DTYPE)
              for _ in range(2)]
    write_kv(*caches, k, v, slots, k_scale, v_scale)
    for cache, values, scale in ((caches[0], k, k_scale), (caches[1], v, v_scale)):
        stored = cache.view(-1, kv_heads, head_dim)[slots].float()
        for head in range(kv_heads):
            want = (values[:, head].float() / float(scale[head])).clamp(-448, 448)
            assert torch.equal(stored[:, head], want.to(FP8_KV_DTYPE).float())
    stored_k = caches[0].view(-1, kv_heads, head_dim)[slots].float()
    assert (stored_k[0, 0, 0], stored_k[1, 1, 1]) == (448.0, -448.0)
    assert torch.isfinite(stored_k).all()
    # Dequantized, every value is within half an FP8 step (1/16 relative) of the original,
    # or of the smallest step near zero.
    back = dequantize_kv(caches[1].view(-1, kv_heads, head_dim)[slots], v_scale)
    bound = v.float().abs() / 16 + 2.0 ** -10 * v_scale[:, None]
    assert ((back - v.float()).abs() <= bound).all()


def test_fp8_cache_without_scales_is_refused():
    cache = torch.zeros(2, 16, 1, 16, dtype=FP8_KV_DTYPE)
    k = torch.randn(1, 1, 16)
    with pytest.raises(ValueError, match="k_scale"):
        write_kv(cache, cache.clone(), k, k, torch.tensor([3]))


@pytest.mark.parametrize(("kv_heads", "head_dim", "dtype"), [
    (1, 16, torch.float32), (2, 64, torch.bfloat16), (3, 24, torch.float32),
    (4, 128, torch.bfloat16)])
def test_triton_store_matches_twin_bit_for_bit(kv_heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(kv_heads)
    blocks, block_size, tokens = 9, 16, 21
    kv = (torch.randn(tokens, 2, kv_heads, head_dim + 8, generator=gen) * 4).to(dtype)
    k, v = kv[:, 0, :, :head_dim], kv[:, 1, :, :head_dim]  # strided, as q/k/v gives them
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    k_scale, v_scale = scales(kv_heads, "cpu")
    expected = [torch.zeros(blocks, block_size, kv_heads, head_dim, dtype=FP8_KV_DTYPE)
                for _ in range(2)]
    write_kv(*expected, k, v, slots, k_scale, v_scale)
    got = [c.clone().to(DEVICE) for c in expected]
    for cache in got:
        cache.view(torch.uint8).zero_()
    write_kv_triton(*got, k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE), k_scale.to(DEVICE),
                    v_scale.to(DEVICE))
    for g, e in zip(got, expected):
        assert torch.equal(bits(g), bits(e))


def check(requests, *, window, dtype=torch.float32, run=paged_attention_triton, kv_heads=2,
          group=2, head_dim=32, block_size=16, **kwargs):
    q, k_cache, v_cache, meta, kind, k_scale, v_scale = fp8_batch(
        requests, window=window, kv_heads=kv_heads, group=group, head_dim=head_dim,
        dtype=dtype, block_size=block_size)
    scale = head_dim ** -0.5
    out = run(q, k_cache, v_cache, meta, kind, window, scale, k_scale, v_scale, **kwargs)
    expected = paged_attention(q.float(), k_cache, v_cache, meta, kind, window, scale, k_scale,
                               v_scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])
    return q, k_cache, v_cache, meta, kind, k_scale, v_scale, out


@pytest.mark.parametrize(("batch", "window", "group", "dtype"), [
    ("decode", None, 1, torch.float32), ("decode", 40, 4, torch.bfloat16),
    ("prefill", None, 2, torch.float32), ("prefill", 16, 8, torch.bfloat16),
    ("mixed", 40, 2, torch.float32), ("mixed", None, 4, torch.bfloat16),
    ("verify", 16, 2, torch.float32), ("verify", None, 1, torch.bfloat16)])
def test_triton_attention_matches_twin(batch, window, group, dtype):
    check(BATCHES[batch], window=window, group=group, dtype=dtype)


@pytest.mark.parametrize("window", [None, 40])
def test_split_decode_and_small_prefill_tiles(window):
    # The V scale applied before the split partials are merged, and across several query and
    # key tiles of the prefill kernel.
    requests = [(700, 1), (300, 1), (5, 1)]
    check(requests, window=window, run=_decode, num_splits=3, block_n=32, kv_heads=1, group=4)
    check(BATCHES["mixed"], window=window, run=_prefill, block_size=32, block_m=32, block_n=16)


def test_fp8_garbage_outside_context_is_ignored():
    q, k_cache, v_cache, meta, kind, k_scale, v_scale, out = check(BATCHES["mixed"], window=16)
    # NaN (an FP8 E4M3 bit pattern) in every slot no query may see.
    seen = torch.zeros(k_cache.shape[:2], dtype=torch.bool, device=DEVICE)
    for r in range(meta.num_requests):
        first_query = int(meta.positions[int(meta.query_start[r])])
        for pos in range(max(0, first_query - 16 + 1), int(meta.seq_lens[r])):
            block = kind.block_tables[r, pos // meta.block_size - int(kind.first_block[r])]
            seen[block, pos % meta.block_size] = True
    for cache in (k_cache, v_cache):
        cache.view(torch.uint8)[~seen] = 0x7F
    again = paged_attention_triton(q, k_cache, v_cache, meta, kind, 16, q.shape[-1] ** -0.5,
                                   k_scale, v_scale)
    torch.testing.assert_close(again, out, atol=0, rtol=0)


def plain_attention(q, k_cache, v_cache, meta, kind, window, scale, k_scale, v_scale):
    """Each token's attention, one at a time, over its request's keys read back through the
    block table and dequantized: what the paged twin computes, without its padding."""
    keys = dequantize_kv(k_cache, k_scale)  # [blocks, block_size, kv_heads, dim]
    values = dequantize_kv(v_cache, v_scale)
    group = q.shape[1] // k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float32)
    for token in range(q.shape[0]):
        request = int(meta.token_request[token])
        position = int(meta.positions[token])
        first = int(kind.first_block[request])
        low = 0 if window is None else max(0, position - window + 1)
        positions = list(range(max(low, first * meta.block_size), position + 1))
        blocks = [int(kind.block_tables[request, p // meta.block_size - first])
                  for p in positions]
        offsets = [p % meta.block_size for p in positions]
        k = keys[blocks, offsets].repeat_interleave(group, dim=1)  # [keys, heads, dim]
        v = values[blocks, offsets].repeat_interleave(group, dim=1)
        weights = (torch.einsum("hd,nhd->hn", q[token].float(), k) * scale).softmax(-1)
        out[token] = torch.einsum("hn,nhd->hd", weights, v)
    return out


@pytest.mark.parametrize(("batch", "window", "group"), [
    ("decode", None, 2), ("prefill", 16, 1), ("mixed", 40, 4), ("verify", 16, 2)])
def test_twin_is_plain_attention_over_the_dequantized_cache(batch, window, group):
    q, k_cache, v_cache, meta, kind, k_scale, v_scale = fp8_batch(
        BATCHES[batch], window=window, group=group, device="cpu")
    scale = q.shape[-1] ** -0.5
    got = paged_attention(q, k_cache, v_cache, meta, kind, window, scale, k_scale, v_scale)
    want = plain_attention(q, k_cache, v_cache, meta, kind, window, scale, k_scale, v_scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
