"""The Triton paged attention kernels against the torch twin, on small random batches
(`tests.kernels.paged_batches`)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from muse.kernels.paged_attention import paged_attention
from muse.kernels.paged_attention_triton import (
    _DECODE_BLOCK_N,
    _decode,
    _decode_splits,
    _prefill,
    paged_attention_triton,
)
from tests.kernels.paged_batches import make_batch

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def check(requests, *, device, block_size=16, window=None, kv_heads=2, group=2, head_dim=32,
          dtype=torch.float32, run=paged_attention_triton, extra_width=0, **kwargs):
    q, k_cache, v_cache, meta, kind = make_batch(
        requests, block_size=block_size, window=window, kv_heads=kv_heads, group=group,
        head_dim=head_dim, dtype=dtype, device=device, extra_width=extra_width)
    scale = head_dim ** -0.5
    out = run(q, k_cache, v_cache, meta, kind, window, scale, **kwargs)
    expected = paged_attention(q.float(), k_cache.float(), v_cache.float(), meta, kind, window,
                               scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])
    return q, k_cache, v_cache, meta, kind, out


DECODE = [(0, 1), (16, 1), (69, 1), (200, 1)]
PREFILL = [(0, 37), (0, 5), (0, 16)]
# Chunked prefill with cached context, next to decodes and a fresh prompt.
MIXED = [(50, 1), (33, 20), (0, 9), (120, 1), (70, 24)]
# Speculative verification: a few queries per request after long contexts (decoded per token).
VERIFY = [(50, 8), (120, 3), (16, 5), (0, 4), (200, 1)]
BATCHES = {"decode": DECODE, "prefill": PREFILL, "mixed": MIXED, "verify": VERIFY}


# Every batch kind meets every window and GQA group sizes 1, 2, 4 and 8, without the full
# product: the interpreter runs each case in about a second.
@pytest.mark.parametrize(("batch", "window", "group"), [
    ("decode", None, 1), ("decode", 16, 4), ("decode", 40, 2), ("decode", None, 8),
    ("prefill", None, 4), ("prefill", 16, 1), ("prefill", 40, 2),
    ("mixed", None, 2), ("mixed", 16, 4), ("mixed", 40, 1), ("mixed", 40, 8),
    ("verify", None, 2), ("verify", 16, 4), ("verify", 40, 1)])
def test_matches_twin(device, batch, window, group):
    *_, kind, _ = check(BATCHES[batch], device=device, window=window, group=group)
    if window is not None and batch != "prefill":
        assert int(kind.first_block.max()) > 0  # sliding tables that skip leading blocks


@pytest.mark.parametrize(("batch", "dtype"), [
    ("decode", torch.bfloat16), ("prefill", torch.bfloat16), ("mixed", torch.bfloat16),
    ("mixed", torch.float16)])
def test_half_precision(device, batch, dtype):
    check(BATCHES[batch], device=device, window=40, group=2, dtype=dtype)


@pytest.mark.parametrize(("group", "head_dim", "block_size"),
                         [(2, 64, 32), (1, 128, 16), (8, 16, 16), (4, 24, 32)])
@pytest.mark.parametrize("batch", ["decode", "mixed"])
def test_shapes(device, batch, group, head_dim, block_size):
    check(BATCHES[batch], device=device, window=16, group=group, head_dim=head_dim,
          block_size=block_size, kv_heads=1)


@pytest.mark.parametrize("window", [None, 40])
def test_long_decode_uses_several_splits(device, window):
    # 700 keys in 16-token pages: the default choice splits them (keys per split >= 256).
    requests = [(700, 1), (300, 1), (5, 1)]
    *_, meta, kind, _ = check(requests, device=device, window=window, group=4)
    splits = _decode_splits(meta.num_requests, 2, kind.block_tables.shape[1],
                            meta.block_size, _DECODE_BLOCK_N, torch.device(device))
    # Sliding tables only hold the window, so they stay short and need no split.
    assert splits > 1 if window is None else splits == 1


@pytest.mark.parametrize(("num_splits", "window"), [(1, None), (3, 16), (8, None), (8, 40)])
def test_decode_split_counts(device, num_splits, window):
    # Splits of 26 keys straddle the 32-key tiles; short and sliding rows leave splits empty.
    check(DECODE, device=device, window=window, kv_heads=1, run=_decode, num_splits=num_splits,
          block_n=32)


def test_decode_many_splits_of_wide_heads(device):
    """64 splits of 128-wide heads (the most splits, the widest heads of the shapes timed)."""
    check(DECODE, device=device, kv_heads=1, head_dim=128, run=_decode, num_splits=64,
          block_n=16)


def test_split_combine_compiles_for_hopper() -> None:
    from tests.kernels.hopper_compile import assert_script_compiles
    assert_script_compiles(r"""
from tests.kernels.hopper_compile import compile_for_hopper
from muse.kernels import paged_attention_triton as p
compile_for_hopper(p._split_kv_combine_kernel,
                   dict(out_ptr="*bf16", ws_acc_ptr="*fp32", ws_m_ptr="*fp32", ws_l_ptr="*fp32",
                        query_start_ptr="*i64"),
                   dict(HEAD_DIM=128, BLOCK_D=128, NUM_SPLITS=64, BLOCK_S=64, PDL=True),
                   set(), num_warps=1)
print("compiled")
""")


@pytest.mark.parametrize(("window", "group"), [(None, 1), (16, 8), (40, 2)])
def test_prefill_small_tiles(device, window, group):
    # 16-token query tiles (several per chunk) and key tiles smaller than a 32-token page.
    check(MIXED, device=device, window=window, group=group, block_size=32, run=_prefill,
          block_m=16 * group, block_n=16)


@pytest.mark.parametrize("window", [None, 100])
def test_prefill_long_chunks_cross_every_key_region(device, window):
    # Chunks after a long cached context: per query tile, the window's masked lower edge,
    # several whole key tiles every row sees, and the masked causal diagonal.
    check([(300, 40), (0, 70), (180, 1)], device=device, window=window, group=2,
          run=_prefill, block_m=32, block_n=32)


@pytest.mark.parametrize(("batch", "window"), [("decode", 16), ("mixed", None), ("mixed", 16)])
def test_garbage_outside_context_is_ignored(device, batch, window):
    q, k_cache, v_cache, meta, kind, out = check(BATCHES[batch], device=device, window=window)
    # Every slot no query may see: the null block, unused blocks, the tail of each last page
    # and, for sliding layers, the table's pages before the window.
    seen = torch.zeros(k_cache.shape[:2], dtype=torch.bool, device=device)
    for r in range(meta.num_requests):
        start = int(meta.query_start[r])
        first_query = int(meta.positions[start])
        seq_len = int(meta.seq_lens[r])
        low = 0 if window is None else max(0, first_query - window + 1)
        for pos in range(low, seq_len):
            block = kind.block_tables[r, pos // meta.block_size - int(kind.first_block[r])]
            seen[block, pos % meta.block_size] = True
    for cache in (k_cache, v_cache):
        cache[~seen] = float("nan")
    again = paged_attention_triton(q, k_cache, v_cache, meta, kind, window, q.shape[-1] ** -0.5)
    torch.testing.assert_close(again, out, atol=0, rtol=0)


@pytest.mark.parametrize(("num_splits", "window"), [(None, None), (8, None), (8, 40)])
def test_decode_with_tables_wider_than_needed(device, num_splits, window):
    # As in a captured graph: 60 unused columns; every request's keys still spread over the
    # splits by its own length.
    check(DECODE, device=device, window=window, kv_heads=1, run=_decode, num_splits=num_splits,
          extra_width=60)
