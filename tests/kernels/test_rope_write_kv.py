"""q/k norm + RoPE with the K/V store in the same launch (`qk_norm_rope_write_kv`): the same
q and the same cache bits as the two kernels it replaces (`qk_norm_rope_triton`, then
`write_kv_triton`), with bf16 and FP8 caches, and its twin is the twins' composition."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from muse.kernels.kv_write import write_kv_triton  # noqa: E402
from muse.kernels.paged_attention import FP8_KV_DTYPE, write_kv  # noqa: E402
from muse.kernels.rotary import (qk_norm_rope_torch, qk_norm_rope_write_kv,  # noqa: E402
                                 qk_norm_rope_write_kv_torch)
from muse.kernels.rotary_triton import qk_norm_rope_triton  # noqa: E402
from tests.conftest import DEVICE  # noqa: E402
from tests.kernels.test_rotary import assert_close_ulps, make  # noqa: E402

EPS = 1e-6
BLOCKS, BLOCK_SIZE = 9, 16


def _inputs(tokens: int, q_heads: int, kv_heads: int, dim: int, dtype: torch.dtype,
            norm: bool, fp8: bool, seed: int):
    """q, k, v as strided views of one fused projection row, caches filled with noise
    (so every slot the store misses would show), slots and scales."""
    q, k, q_weight, k_weight, cos, sin = make(tokens, q_heads, kv_heads, dim, dtype, norm, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    fused = torch.cat([q.flatten(1), k.flatten(1),
                       (torch.randn(tokens, kv_heads * dim, generator=gen) * 2).to(DEVICE, dtype)],
                      dim=1)
    q = fused[:, :q_heads * dim].view(tokens, q_heads, dim)
    k = fused[:, q_heads * dim:(q_heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = fused[:, (q_heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
    cache_dtype = FP8_KV_DTYPE if fp8 else dtype
    caches = [torch.randn(BLOCKS, BLOCK_SIZE, kv_heads, dim, generator=gen).to(DEVICE,
                                                                              cache_dtype)
              for _ in range(2)]
    slots = torch.randperm(BLOCKS * BLOCK_SIZE, generator=gen)[:tokens].to(DEVICE)
    scales = (None, None)
    if fp8:
        scales = tuple((0.5 + torch.rand(kv_heads, generator=gen)).to(DEVICE) for _ in range(2))
    return (q, k, v, q_weight, k_weight, cos, sin), caches, slots, scales


def _bits(cache: torch.Tensor) -> torch.Tensor:
    return cache.cpu().view(torch.uint8) if cache.element_size() == 1 else cache.cpu()


# (tokens, q heads, kv heads, head_dim, dtype, norm, fp8 cache). Past 64 tokens a program
# takes several heads (the last group partly masked).
CASES = [
    (1, 8, 2, 64, torch.bfloat16, True, False),
    (3, 4, 4, 32, torch.float32, False, False),
    (5, 6, 3, 16, torch.bfloat16, True, True),
    (2, 2, 1, 128, torch.float32, True, True),
    (65, 5, 3, 16, torch.bfloat16, True, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}_q{}_k{}_d{}_{}_{}_{}".format(
    *c[:4], str(c[4])[6:], "norm" if c[5] else "plain", "fp8" if c[6] else "cache"))
def test_one_launch_stores_what_the_two_kernels_store(case) -> None:
    tokens, q_heads, kv_heads, dim, dtype, norm, fp8 = case
    (q, k, v, qw, kw, cos, sin), caches, slots, scales = _inputs(
        tokens, q_heads, kv_heads, dim, dtype, norm, fp8, seed=tokens + dim)
    expected = [c.clone() for c in caches]
    q_two, k_two = qk_norm_rope_triton(q, k, qw, kw, cos, sin, EPS)
    write_kv_triton(*expected, k_two, v, slots, *scales)

    got = [c.clone() for c in caches]
    q_one = qk_norm_rope_write_kv(q, k, v, qw, kw, cos, sin, EPS, *got, slots, *scales)
    assert torch.equal(q_one, q_two)
    for g, e in zip(got, expected):
        assert torch.equal(_bits(g), _bits(e))
    # The store really happened: the new slots changed, the others did not.
    untouched = torch.ones(BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    untouched[slots.cpu()] = False
    for g, before in zip(got, caches):
        flat_g, flat_b = _bits(g).flatten(0, 1), _bits(before).flatten(0, 1)
        assert torch.equal(flat_g[untouched], flat_b[untouched])
        assert not torch.equal(flat_g[~untouched], flat_b[~untouched])


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_twin_is_the_twins_composition_and_the_kernel_is_close_to_it(fp8: bool) -> None:
    (q, k, v, qw, kw, cos, sin), caches, slots, scales = _inputs(
        4, 4, 2, 64, torch.bfloat16, True, fp8, seed=7)
    twin = [c.clone() for c in caches]
    q_twin = qk_norm_rope_write_kv_torch(q, k, v, qw, kw, cos, sin, EPS, *twin, slots, *scales)
    q_ref, k_ref = qk_norm_rope_torch(q, k, qw, kw, cos, sin, EPS)
    composed = [c.clone() for c in caches]
    write_kv(*composed, k_ref, v, slots, *scales)
    assert torch.equal(q_twin, q_ref)
    for t, c in zip(twin, composed):
        assert torch.equal(_bits(t), _bits(c))

    kernel = [c.clone() for c in caches]
    q_kernel = qk_norm_rope_write_kv(q, k, v, qw, kw, cos, sin, EPS, *kernel, slots, *scales)
    assert_close_ulps(q_kernel, q_twin)
    # Values are copied (scaled) as they are: the same bits; keys within the rotation's ulps.
    assert torch.equal(_bits(kernel[1]), _bits(twin[1]))
    keys, twin_keys = kernel[0].float(), twin[0].float()
    step = 2.0 ** -3 if fp8 else 4 * torch.finfo(torch.bfloat16).eps
    assert ((keys - twin_keys).abs() <= step * twin_keys.abs().clamp(min=1.0)).all()


def test_calls_the_kernel_does_not_take_use_the_twin() -> None:
    """A norm weight for q alone: the twin runs (and still stores the keys and values)."""
    (q, k, v, qw, _, cos, sin), caches, slots, _ = _inputs(2, 2, 1, 16, torch.float32, True,
                                                           False, seed=3)
    twin = [c.clone() for c in caches]
    q_twin = qk_norm_rope_write_kv_torch(q, k, v, qw, None, cos, sin, EPS, *twin, slots)
    got = [c.clone() for c in caches]
    assert torch.equal(qk_norm_rope_write_kv(q, k, v, qw, None, cos, sin, EPS, *got, slots),
                       q_twin)
    for g, t in zip(got, twin):
        assert torch.equal(g, t)
