"""The one-launch K/V store against the indexed-copy twin."""

import pytest
import torch

from muse.kernels.paged_attention import write_kv
from tests.conftest import DEVICE

pytest.importorskip("triton")
from muse.kernels.kv_write import write_kv_triton  # noqa: E402


@pytest.mark.parametrize(("kv_heads", "head_dim", "dtype"), [
    (1, 16, torch.float32), (2, 64, torch.bfloat16), (3, 24, torch.float32),
    (4, 128, torch.bfloat16)])
def test_matches_twin(kv_heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(kv_heads)
    blocks, block_size, tokens = 9, 16, 21
    caches = [torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
              for _ in range(2)]
    # Strided k and v, as the fused q/k/v projection produces them.
    kv = torch.randn(tokens, 2, kv_heads, head_dim + 8, generator=gen).to(dtype)
    k, v = kv[:, 0, :, :head_dim], kv[:, 1, :, :head_dim]
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    expected = [c.clone() for c in caches]
    write_kv(*expected, k, v, slots)
    got = [c.clone().to(DEVICE) for c in caches]
    write_kv_triton(*got, k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE))
    for g, e in zip(got, expected):
        assert torch.equal(g.cpu(), e)
