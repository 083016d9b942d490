"""The skinny decode matmul: Triton kernel against its twin, F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("triton")

from muse.kernels.linear import (  # noqa: E402
    EngineLinear,
    linear,
    tune_decode_linears,
    use_engine_linears,
)
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


def test_dispatch_keeps_f_linear_off_cuda():
    x, weight = torch.randn(2, 8), torch.randn(4, 8)
    assert torch.equal(linear(x, weight), F.linear(x, weight))
    bias = torch.randn(4)
    assert torch.equal(linear(x, weight, bias), F.linear(x, weight, bias))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times CUDA graphs")
def test_tuning_measures_every_shape_and_row_count_and_keeps_results_equal():
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * k ** -0.5
               for n, k in [(128, 2048), (128, 2048), (5120, 2048), (2048, 4096)]]
    results = tune_decode_linears(weights, [1, 2, 4, 8, 16, 32])
    assert {(r["out"], r["in"], r["rows"]) for r in results} == {
        (n, k, rows) for n, k in [(128, 2048), (5120, 2048), (2048, 4096)]
        for rows in (1, 2, 4, 8, 16)}
    assert all(r["triton"] == (r["triton_us"] < 0.95 * r["cublas_us"]) for r in results)
    for weight in weights:
        x = torch.randn(4, weight.shape[1], dtype=torch.bfloat16, device="cuda")
        torch.testing.assert_close(linear(x, weight).float(), F.linear(x, weight).float(),
                                   rtol=2e-2, atol=2e-2)


def test_engine_linears_keep_parameters_and_names():
    model = nn.Sequential(nn.Linear(8, 4, bias=False), nn.ReLU(), nn.Linear(4, 2))
    before = {name: p for name, p in model.named_parameters()}
    x = torch.randn(3, 8)
    expected = model(x)
    use_engine_linears(model)
    assert all(isinstance(m, EngineLinear) for m in (model[0], model[2]))
    assert {name: p for name, p in model.named_parameters()} == before
    torch.testing.assert_close(model(x), expected)
