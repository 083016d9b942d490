"""The torch twin of paged attention against attention written out request by request, and
its CPU form of a mixed step (decodes attended apart from the prefill chunks) against the one
padded call it replaces."""

from __future__ import annotations

import pytest
import torch

from muse.kernels import paged_attention as twin
from muse.kernels.paged_attention import FP8_KV_DTYPE, paged_attention, quantize_kv
from tests.kernels.paged_batches import make_batch

# (cached tokens, new tokens) per request.
BATCHES = {
    "decode": [(0, 1), (16, 1), (69, 1), (200, 1)],
    "prefill": [(0, 37), (0, 5), (33, 16)],
    "mixed": [(50, 1), (33, 20), (0, 9), (120, 1), (70, 24), (3, 1)],
    "one chunk among decodes": [(90, 1), (7, 1), (0, 64), (41, 1)],
}


def written_out(q, k_cache, v_cache, meta, kind, window, scale):
    """Each token's softmax over the keys it may see, read one position at a time."""
    block_size, group = meta.block_size, q.shape[1] // k_cache.shape[2]
    out = torch.zeros_like(q)
    for token in range(q.shape[0]):
        request = int(meta.token_request[token])
        position = int(meta.positions[token])
        first = int(kind.first_block[request]) * block_size
        lowest = first if window is None else max(first, position - window + 1)
        slots = [int(kind.block_tables[request, j // block_size - first // block_size])
                 * block_size + j % block_size for j in range(lowest, position + 1)]
        keys = k_cache.flatten(0, 1)[slots].float()  # [keys, kv_heads, dim]
        values = v_cache.flatten(0, 1)[slots].float()
        for head in range(q.shape[1]):
            scores = keys[:, head // group] @ q[token, head].float() * scale
            out[token, head] = scores.softmax(0) @ values[:, head // group]
    return out


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("window", [None, 16])
def test_twin_equals_attention_written_out(batch, window):
    q, k_cache, v_cache, meta, kind = make_batch(
        BATCHES[batch], block_size=8, window=window, kv_heads=2, group=2, head_dim=16,
        dtype=torch.float32, device="cpu")
    scale = 16 ** -0.5
    got = paged_attention(q, k_cache, v_cache, meta, kind, window, scale)
    want = written_out(q, k_cache, v_cache, meta, kind, window, scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fp8", [False, True])
def test_mixed_step_attends_decodes_apart_and_equals_one_padded_call(monkeypatch, fp8):
    q, k_cache, v_cache, meta, kind = make_batch(
        BATCHES["mixed"], block_size=8, window=None, kv_heads=2, group=4, head_dim=16,
        dtype=torch.float32, device="cpu", seed=3)
    scales = None
    if fp8:
        scales = (torch.tensor([0.02, 0.03]), torch.tensor([0.025, 0.01]))
        k_cache = quantize_kv(k_cache.flatten(0, 1), scales[0]).view(k_cache.shape)
        v_cache = quantize_kv(v_cache.flatten(0, 1), scales[1]).view(v_cache.shape)
        assert k_cache.dtype == FP8_KV_DTYPE
    one_call = twin._padded_attention(
        q, k_cache, v_cache, meta.positions, meta.token_request, meta.query_start,
        meta.max_query_len, meta.seq_lens, kind.block_tables, kind.first_block,
        meta.block_size, None, 0.25, scales)

    calls = []
    padded = twin._padded_attention
    monkeypatch.setattr(twin, "_padded_attention",
                        lambda q, *rest: calls.append(q.shape[0]) or padded(q, *rest))
    k_scale, v_scale = scales or (None, None)
    got = paged_attention(q, k_cache, v_cache, meta, kind, None, 0.25, k_scale, v_scale)
    # The three decodes in one call, the three chunks' 53 tokens in the other.
    assert calls == [3, 53]
    torch.testing.assert_close(got, one_call, atol=1e-6, rtol=1e-6)
