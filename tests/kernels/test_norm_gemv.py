"""The GEMV with the RMSNorm in its prologue (`muse.kernels.norm_gemv_triton.norm_gemv`)
against its twin, the norm then `F.linear`, and the dispatch `norm_linear` makes. Small
sizes: on the CPU the kernel runs under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from muse.kernels import norm_linear as norm_linear_module  # noqa: E402
from muse.kernels.gemv_triton import GemvTiles  # noqa: E402
from muse.kernels.norm_gemv_triton import norm_gemv  # noqa: E402
from muse.kernels.norms import add_rms_norm_torch, rms_norm_torch  # noqa: E402
from muse.kernels.norms_triton import add_rms_norm_triton, rms_norm_triton  # noqa: E402
from tests.conftest import DEVICE  # noqa: E402

CASES = [
    # (N, K, tiles): K over several BLOCK_K steps, K not a multiple of the tile, K split
    # over programs, a single output, the default tiles
    (37, 200, GemvTiles(16, 64, 4)),
    (50, 192, GemvTiles(16, 32, 2, split_k=3)),
    (1, 48, GemvTiles(16, 16, 1, split_k=3)),
    (70, 256, None),
]


def _operands(out: int, inp: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(inp, generator=gen) * 3).to(DEVICE, dtype)
    residual = torch.randn(inp, generator=gen).to(DEVICE, dtype)
    norm_weight = (1 + 0.1 * torch.randn(inp, generator=gen)).to(DEVICE, dtype)
    weight = (torch.randn(out, inp, generator=gen) * inp ** -0.5).to(DEVICE, dtype)
    return x, residual, norm_weight, weight


def _ulps(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference in units of the last place of the expected row's largest
    element (as `tests/kernels/test_norms.py` measures its norms)."""
    scale = expected.float().abs().max().clamp(min=1.0)
    return float((actual.float() - expected.float()).abs().max()
                 / (torch.finfo(expected.dtype).eps * scale))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first-layer"])
@pytest.mark.parametrize(("out", "inp", "tiles"), CASES)
def test_norm_gemv_matches_norm_then_linear(dtype: torch.dtype, with_residual: bool, out: int,
                                           inp: int, tiles: GemvTiles | None) -> None:
    """The residual sum is the norm kernel's bit for bit (one float32 add, one cast: under
    the interpreter the cast truncates, on a GPU it rounds, the same in both kernels); the
    normed row is within a unit of the last place of both norms (the sum of squares is
    reduced in another order, the interpreter's cast truncates); the product is within the
    plain GEMV's tolerance, relative to the sum of the terms' sizes."""
    x, residual, norm_weight, weight = _operands(out, inp, dtype, seed=out + inp)
    eps = 1e-6
    res = residual if with_residual else None
    y, h, summed = norm_gemv(x, res, norm_weight, eps, weight, tiles=tiles)
    assert y.shape == (out,) and h.shape == (inp,) and y.dtype == h.dtype == dtype
    if with_residual:
        kernel_h, kernel_sum = add_rms_norm_triton(x[None], residual[None], norm_weight, eps)
        twin_h, twin_sum = add_rms_norm_torch(x, residual, norm_weight, eps)
        assert torch.equal(summed, kernel_sum[0])
        assert _ulps(summed, twin_sum) <= 1
    else:
        kernel_h = rms_norm_triton(x[None], norm_weight, eps)
        twin_h = rms_norm_torch(x, norm_weight, eps)
        assert summed is x
    assert _ulps(h, kernel_h[0]) <= 1 and _ulps(h, twin_h) <= 2
    ulp = torch.finfo(dtype).eps
    size = weight.double().abs() @ h.double().abs()
    assert ((y.double() - (weight.double() @ h.double())).abs() <= 2 * ulp * size).all()
    twin_y = F.linear(twin_h[None], weight)[0]
    assert ((y.double() - twin_y.double()).abs() <= 8 * ulp * size).all()


def test_norm_weight_scales_each_input() -> None:
    """A negative control for the prologue: zeroing one norm weight removes that input's
    column from the product, exactly."""
    x, residual, norm_weight, weight = _operands(9, 40, torch.bfloat16, seed=3)
    weight = weight.clone()
    weight[:, 1:] = 0
    y, _, _ = norm_gemv(x, residual, norm_weight, 1e-6, weight)
    assert (y != 0).any()
    norm_weight = norm_weight.clone()
    norm_weight[0] = 0
    y, _, _ = norm_gemv(x, residual, norm_weight, 1e-6, weight)
    assert (y == 0).all()


def test_norm_linear_runs_the_kernel_or_its_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    """`norm_linear` takes the kernel for one 16-bit row where the GEMV would run (forced
    here: on the CPU the GEMV's dispatch declines) and the backend's norm with `F.linear`
    otherwise; both give the same residual and the product within the GEMV's tolerance."""
    x, residual, norm_weight, weight = _operands(24, 64, torch.bfloat16, seed=11)
    x, residual = x[None], residual[None]
    calls = []

    def add_rms_norm(*args):
        calls.append("norm")
        return add_rms_norm_torch(*args)

    twin = norm_linear_module.norm_linear(x, residual, norm_weight, 1e-6, weight,
                                          rms_norm_torch, add_rms_norm)
    assert calls == ["norm"]
    monkeypatch.setattr(norm_linear_module, "NORM_GEMV_ON", True)
    monkeypatch.setattr(norm_linear_module, "takes_gemv", lambda x, w: True)
    fused = norm_linear_module.norm_linear(x, residual, norm_weight, 1e-6, weight,
                                           rms_norm_torch, add_rms_norm)
    assert calls == ["norm"]  # the kernel normed the row itself
    assert fused[0].shape == twin[0].shape == (1, 24)
    assert (fused[2] - twin[2]).abs().max() <= 2 * torch.finfo(torch.bfloat16).eps * \
        twin[2].abs().max()
    size = weight.double().abs() @ twin[1][0].double().abs()
    assert ((fused[0][0].double() - twin[0][0].double()).abs()
            <= 6 * torch.finfo(torch.bfloat16).eps * size).all()
    # Two rows never take the one-row kernel.
    both = norm_linear_module.norm_linear(x.expand(2, -1), residual.expand(2, -1),
                                          norm_weight, 1e-6, weight, rms_norm_torch,
                                          add_rms_norm)
    assert calls == ["norm", "norm"] and both[0].shape == (2, 24)
