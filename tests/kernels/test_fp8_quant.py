"""The one-launch per-token FP8 activation quantization equals its torch twin, byte for byte."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from muse.kernels.fp8_gemm import quantize_fp8_per_token  # noqa: E402
from muse.kernels.fp8_quant_triton import quantize_fp8_per_token_triton  # noqa: E402
from tests.conftest import DEVICE  # noqa: E402


def rows(shape: tuple[int, int], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator) * torch.logspace(-3, 3, shape[0])[:, None]
    x[0] = 0.0  # an all-zero row keeps a positive scale
    if shape[0] > 2:
        x[2, shape[1] // 2] = 1e4  # one outlier sets its row's scale
    return x.to(dtype).to(DEVICE)


def assert_same(got: tuple[torch.Tensor, torch.Tensor],
                want: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert got[0].dtype == want[0].dtype == torch.float8_e4m3fn
    assert got[1].shape == want[1].shape and got[1].dtype == torch.float32
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 2048), (5, 1000), (7, 16), (3, 12288)])
def test_dynamic_scales_match_the_twin(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    x = rows(shape, dtype)
    assert_same(quantize_fp8_per_token_triton(x), quantize_fp8_per_token(x))


def test_static_scale_saturates_as_the_twin() -> None:
    x = rows((4, 300), torch.bfloat16, seed=1)
    scale = torch.tensor(0.05, device=DEVICE)  # small: large values saturate at +-448
    got = quantize_fp8_per_token_triton(x, scale)
    assert_same(got, quantize_fp8_per_token(x, scale))
    assert got[0].float().abs().max() == 448.0


def test_strided_rows_and_no_rows() -> None:
    x = rows((6, 256), torch.bfloat16)[::2]
    assert_same(quantize_fp8_per_token_triton(x), quantize_fp8_per_token(x))
    empty = torch.empty((0, 64), dtype=torch.bfloat16, device=DEVICE)
    assert quantize_fp8_per_token_triton(empty)[0].shape == (0, 64)


def test_kernel_compiles_for_hopper() -> None:
    from tests.kernels.hopper_compile import assert_script_compiles
    assert_script_compiles(r"""
from tests.kernels.hopper_compile import compile_for_hopper
from muse.kernels import fp8_quant_triton as q
for static in (False, True):
    compile_for_hopper(q._quantize_rows_kernel,
                       {"x_ptr": "*bf16", "out_ptr": "*fp8e4nv", "scale_ptr": "*fp32",
                        "static_scale_ptr": "*fp32"},
                       dict(STATIC=static, BLOCK=2048, FP8_MAX=448.0, MIN_AMAX=1e-12), set(), 4)
print("compiled")
""")
