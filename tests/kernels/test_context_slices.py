"""`HostBatch.token_slice`, what a context-parallel rank runs: attention of a slice's queries
equals those rows of the whole batch's attention, wherever the cut falls, with the torch
twin and with the Triton kernels (which place a request's queries from its seq_len)."""

from __future__ import annotations

import pytest
import torch

from muse.engine.metadata import HostBatch
from muse.kernels.paged_attention import paged_attention
from tests.conftest import DEVICE


def backends() -> list:
    found = [pytest.param(paged_attention, id="torch")]
    try:
        from muse.kernels.paged_attention_triton import paged_attention_triton
    except ImportError:
        return found
    return found + [pytest.param(paged_attention_triton, id="triton")]

BLOCK = 4
KINDS = ["full_attention", "sliding_attention"]
WINDOW = 6


def batch() -> HostBatch:
    """Request 0: 13 cached tokens and 7 new (positions 13..19); request 1: a 10-token
    prompt; request 2: one decode token at position 8. Tables are distinct blocks."""
    news = [(13, 7), (0, 10), (8, 1)]
    host = HostBatch(kinds=list(KINDS), max_query_len=10)
    next_block = 1
    for index, (start, count) in enumerate(news):
        end = start + count
        table = list(range(next_block, next_block + -(-end // BLOCK)))
        next_block += len(table)
        host.input_ids += list(range(count))
        host.positions += list(range(start, end))
        host.token_request += [index] * count
        host.query_start.append(host.query_start[-1] + count)
        host.seq_lens.append(end)
        for kind in KINDS:
            host.slots[kind] += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)]
            host.tables[kind].append(table)
            host.first_blocks[kind].append(0)
    return host


@pytest.mark.parametrize("attention", backends())
@pytest.mark.parametrize("cut", [1, 3, 7, 8, 12, 17])
def test_slices_attend_like_the_whole_batch(cut: int, attention):
    torch.manual_seed(0)
    whole = batch()
    device = torch.device(DEVICE)
    k_cache = torch.randn(16, BLOCK, 2, 16, device=device)
    v_cache = torch.randn(16, BLOCK, 2, 16, device=device)
    q = torch.randn(whole.num_tokens, 4, 16, device=device)
    outputs = {}
    for host, rows in ((whole, range(whole.num_tokens)),
                       (whole.token_slice(0, cut), range(0, cut)),
                       (whole.token_slice(cut, whole.num_tokens), range(cut, whole.num_tokens))):
        _, meta = host.to_device(device, BLOCK)
        for kind, window in zip(KINDS, (None, WINDOW)):
            out = attention(q[rows.start:rows.stop], k_cache, v_cache, meta,
                                  meta.kinds[kind], window, 0.3)
            outputs.setdefault(kind, []).append(out)
    for kind, (full, first, second) in outputs.items():
        # The same sums over other padded shapes: float32 rounding apart, equal.
        torch.testing.assert_close(torch.cat([first, second]), full, rtol=1e-5, atol=1e-5)


def test_a_slice_keeps_the_tokens_and_their_requests():
    whole = batch()
    part = whole.token_slice(5, 12)  # the last 2 of request 0, the first 5 of request 1
    assert part.input_ids == whole.input_ids[5:12]
    assert part.positions == whole.positions[5:12]
    assert part.token_request == [0, 0, 1, 1, 1, 1, 1]
    assert part.query_start == [0, 2, 7]
    assert part.seq_lens == [20, 5]  # request 1 attends as if its context ended at the cut
    assert part.max_query_len == 5
    assert part.tables["full_attention"] == whole.tables["full_attention"][:2]
    assert part.slots["full_attention"] == whole.slots["full_attention"][5:12]
