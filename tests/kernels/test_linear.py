"""The skinny decode matmul: Triton kernel against its twin, F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("triton")

from muse.kernels.linear import EngineLinear, linear, use_engine_linears  # noqa: E402
from muse.kernels.linear_triton import skinny_linear  # noqa: E402
from tests.conftest import DEVICE  # noqa: E402

# (rows, out, in): one to sixteen rows; widths that are not multiples of the tiles and depths
# shorter than one K step exercise the masks.
SHAPES = [(1, 128, 256), (3, 40, 72), (8, 100, 600), (16, 64, 1000), (5, 16, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width,depth", SHAPES)
def test_skinny_kernel_matches_f_linear(rows, width, depth, dtype):
    gen = torch.Generator().manual_seed(rows * width + depth)
    x = torch.randn(rows, depth, generator=gen).to(dtype).to(DEVICE)
    weight = torch.randn(width, depth, generator=gen).to(dtype).to(DEVICE)
    actual = skinny_linear(x, weight)
    expected = F.linear(x.float(), weight.float())
    assert actual.dtype == dtype and actual.shape == (rows, width)
    # float32: IEEE products in another summation order; bfloat16: one final rounding.
    tolerance = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(actual.float(), expected, rtol=tolerance,
                               atol=tolerance * depth ** 0.5)


def test_skinny_kernel_reads_strided_rows():
    x = torch.randn(4, 96).to(DEVICE)[:, :64]  # row stride 96, the width of a fused output
    weight = torch.randn(32, 64).to(DEVICE)
    torch.testing.assert_close(skinny_linear(x, weight), F.linear(x, weight), rtol=1e-4,
                               atol=1e-4)


def test_dispatch_keeps_f_linear_off_cuda_and_for_many_rows():
    x, weight = torch.randn(2, 8), torch.randn(4, 8)
    assert torch.equal(linear(x, weight), F.linear(x, weight))
    bias = torch.randn(4)
    assert torch.equal(linear(x, weight, bias), F.linear(x, weight, bias))


def test_engine_linears_keep_parameters_and_names():
    model = nn.Sequential(nn.Linear(8, 4, bias=False), nn.ReLU(), nn.Linear(4, 2))
    before = {name: p for name, p in model.named_parameters()}
    x = torch.randn(3, 8)
    expected = model(x)
    use_engine_linears(model)
    assert all(isinstance(m, EngineLinear) for m in (model[0], model[2]))
    assert {name: p for name, p in model.named_parameters()} == before
    torch.testing.assert_close(model(x), expected)
