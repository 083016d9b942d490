"""The one-launch rows of a verify step made on the device (`chained_rows`) against their
torch twin: random acceptances, starts, windows and tables, one or two kinds, inputs that are
strided views as the verify graphs' outputs are."""

import random

import pytest
import torch

from muse.speculative.chained_step import chained_rows_torch
from tests.conftest import DEVICE

pytest.importorskip("triton")


@pytest.mark.parametrize("seed", range(6))
def test_the_kernel_writes_the_twins_rows(seed):
    from muse.kernels.chained_rows_triton import chained_rows

    rng = random.Random(seed)
    requests, q, kinds = rng.randint(1, 9), rng.randint(2, 9), rng.randint(1, 2)
    block_size = rng.choice([2, 4, 16])
    width = 4 + -(-2 * q // block_size) + rng.randint(0, 3)
    verified = torch.tensor([[rng.randint(0, q - 1)] + [rng.randrange(9000) for _ in range(q)]
                             for _ in range(requests)], device=DEVICE)
    accepted, emitted = verified[:, 0], verified[:, 1:]  # views with a row stride
    drafts = torch.tensor([[rng.randrange(9000) for _ in range(q + 2)]
                           for _ in range(requests)], device=DEVICE)[:, 1:q]
    # Every query's block lies inside its table: the first block is at most the block of
    # the earliest position, the table reaches past the latest.
    firsts = torch.tensor([[rng.randint(0, 3) for _ in range(requests)] for _ in range(kinds)],
                          device=DEVICE)
    lowest, highest = firsts.min(dim=0).values.tolist(), firsts.max(dim=0).values.tolist()
    starts = torch.tensor([high * block_size + rng.randint(
        0, (low + width) * block_size - 2 * q - high * block_size)
        for low, high in zip(lowest, highest)], device=DEVICE)
    tables = torch.randint(1, 500, (kinds, requests, width), device=DEVICE)
    args = (accepted, emitted, drafts, starts, firsts, tables, block_size)
    tokens, request_rows = chained_rows(*args)
    want_tokens, want_requests = chained_rows_torch(*args)
    assert torch.equal(tokens, want_tokens)
    assert torch.equal(request_rows, want_requests)
    assert tokens.shape == (2 + kinds, requests * q)
