"""The one-launch block copies of `KVBlocks` against the indexed-copy twins: gathers (with
repeated blocks) and scatters of a kind's layers out of several, in bf16, float32 and FP8
caches."""

import pytest
import torch

from muse.kernels.kv_blocks import KVBlocks, gather_blocks, put_blocks
from tests.conftest import DEVICE

pytest.importorskip("triton")

LAYERS = 5


def caches(dtype: torch.dtype, heads: int, dim: int, blocks: int = 12, block_size: int = 4,
           seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(blocks, block_size, heads, dim, generator=gen).to(dtype)
                  .to(DEVICE) for _ in range(2)) for _ in range(LAYERS)]


@pytest.mark.parametrize(("dtype", "heads", "dim"), [
    (torch.bfloat16, 2, 64), (torch.float32, 1, 16), (torch.float8_e4m3fn, 4, 128),
    (torch.bfloat16, 3, 24)])
@pytest.mark.parametrize("layers", [[0, 2, 4], [1, 3], [3]])
def test_gather_and_put_match_the_twins(dtype, heads, dim, layers):
    kv = caches(dtype, heads, dim)
    blocks = KVBlocks(kv, layers, use_triton=True)
    wanted = [7, 0, 11, 7, 3]
    (got,), expected = blocks.gather_groups(wanted), gather_blocks(kv, layers, wanted)
    assert got.shape == expected.shape == (5, len(layers), 2, 4, heads, dim)
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))

    rows = caches(dtype, heads, dim, blocks=4, seed=1)
    rows = torch.stack([torch.stack(pair, dim=1) for pair in (rows[i] for i in layers)], dim=1)
    targets = [9, 2, 5, 10]
    twin = [(k.clone(), v.clone()) for k, v in kv]
    blocks.put(targets, rows)
    put_blocks(twin, layers, targets, rows)
    for (k, v), (tk, tv) in zip(kv, twin):  # the other layers and blocks untouched too
        assert torch.equal(k.view(torch.uint8), tk.view(torch.uint8))
        assert torch.equal(v.view(torch.uint8), tv.view(torch.uint8))


def test_a_kind_whose_caches_hold_another_number_of_blocks_than_the_first_layer():
    """Sliding and global layers interleave, each kind with its own block count."""
    sliding, full = caches(torch.bfloat16, 2, 32, blocks=6), caches(torch.bfloat16, 2, 32, seed=2)
    kv = [sliding[0], full[1], sliding[2], full[3], sliding[4]]
    blocks = KVBlocks(kv, [1, 3], use_triton=True)
    assert torch.equal(blocks.gather_groups([11, 2])[0], gather_blocks(kv, [1, 3], [11, 2]))


@pytest.mark.parametrize("groups", [[2, 1], [1, 1, 1], [3]])
def test_gather_groups_in_one_launch_matches_the_twins(groups):
    kv = caches(torch.bfloat16, 2, 32)
    layers = [4, 0, 2]
    fused = KVBlocks(kv, layers, use_triton=True, groups=groups)
    twin = KVBlocks(kv, layers, use_triton=False, groups=groups)
    wanted = [5, 1, 9, 1]
    got, expected = fused.gather_groups(wanted), twin.gather_groups(wanted)
    assert [t.shape for t in got] == [(4, size, 2, 4, 2, 32) for size in groups]
    for mine, theirs in zip(got, expected):
        assert mine.is_contiguous()
        assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))
    with pytest.raises(ValueError, match="must split"):
        KVBlocks(kv, layers, groups=[2, 2])


def test_no_blocks_and_bad_caches():
    kv = caches(torch.float32, 1, 16)
    blocks = KVBlocks(kv, [0, 1], use_triton=True)
    assert blocks.gather_groups([])[0].shape == (0, 2, 2, 4, 1, 16)
    blocks.put([], torch.empty(0, 2, 2, 4, 1, 16, device=DEVICE))
    strided = [(k[:, :2], v[:, :2]) for k, v in kv]
    with pytest.raises(ValueError, match="contiguous"):
        KVBlocks(strided, [0], use_triton=True)
