"""RMSNorm and residual add + RMSNorm: Triton kernel, torch twin and the reference agree."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from muse.kernels.norms import add_rms_norm_torch, rms_norm_torch  # noqa: E402
from muse.kernels.norms_triton import add_rms_norm_triton, rms_norm_triton  # noqa: E402
from muse.reference.layers import rms_norm as reference_rms_norm  # noqa: E402
from tests.conftest import DEVICE  # noqa: E402

EPS = 1e-6
DTYPES = [torch.float32, torch.bfloat16]
# Odd widths exercise the masked tail of the power-of-two block.
SHAPES = [(1, 16), (37, 64), (3, 5, 128), (7, 1000), (2, 17)]
# Allowed error in units of the dtype's epsilon times the largest magnitude. The kernel sums
# squares in another order (float32: a few ulps), and off the GPU the Triton interpreter rounds
# float32 -> bfloat16 towards zero instead of to nearest (bfloat16: about one ulp more).
ULPS = {torch.float32: 8, torch.bfloat16: 4}


def assert_close_ulps(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    scale = expected.float().abs().max().clamp(min=1.0)
    atol = ULPS[expected.dtype] * torch.finfo(expected.dtype).eps * float(scale)
    torch.testing.assert_close(actual.float(), expected.float(), rtol=0.0, atol=atol)


def inputs(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 2).to(dtype).to(DEVICE)
    residual = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    weight = (1 + 0.3 * torch.randn(shape[-1], generator=gen)).to(DEVICE)
    return x, residual, weight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_twins_equal_the_reference_bit_for_bit(shape, dtype):
    x, residual, weight = inputs(shape, dtype)
    assert torch.equal(rms_norm_torch(x, weight, EPS), reference_rms_norm(x, weight, EPS))
    normed, summed = add_rms_norm_torch(x, residual, weight, EPS)
    assert torch.equal(summed, x + residual)
    assert torch.equal(normed, reference_rms_norm(x + residual, weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_rms_norm_matches_the_twin(shape, dtype):
    x, _, weight = inputs(shape, dtype)
    assert_close_ulps(rms_norm_triton(x, weight, EPS), rms_norm_torch(x, weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_add_rms_norm_matches_the_twin(shape, dtype):
    x, residual, weight = inputs(shape, dtype, seed=1)
    normed, summed = add_rms_norm_triton(x, residual, weight, EPS)
    want_normed, want_summed = add_rms_norm_torch(x, residual, weight, EPS)
    if dtype == torch.float32:
        assert torch.equal(summed, want_summed)  # one float32 add, no other rounding
    assert_close_ulps(summed, want_summed)
    assert_close_ulps(normed, want_normed)
    # The norm reads the rounded sum the kernel stored, not a wider intermediate.
    assert_close_ulps(normed, rms_norm_torch(summed, weight, EPS))


def test_triton_reads_strided_rows_and_a_bfloat16_weight():
    x, residual, weight = inputs((9, 160), torch.float32, seed=2)
    view, res_view = x[:, 16:80], residual[:, :64]  # row stride 160, not contiguous
    w = weight[:64].to(torch.bfloat16)
    assert_close_ulps(rms_norm_triton(view, w, EPS), reference_rms_norm(view, w, EPS))
    normed, summed = add_rms_norm_triton(view, res_view, w, EPS)
    assert torch.equal(summed, view + res_view)
    assert_close_ulps(normed, reference_rms_norm(view + res_view, w, EPS))
    columns = x.t()  # column stride != 1 takes the copy path
    assert_close_ulps(rms_norm_triton(columns, weight[:9], EPS),
                      reference_rms_norm(columns, weight[:9], EPS))


def test_no_rows_is_no_launch():
    x = torch.empty(0, 64, device=DEVICE)
    assert rms_norm_triton(x, torch.ones(64, device=DEVICE), EPS).shape == (0, 64)
