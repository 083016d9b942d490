"""y = x @ W^T (+ bias) for an unquantized linear layer: `F.linear`, or for a single activation
row on a GPU (batch-1 decode) the one-row GEMV of `muse.kernels.gemv_triton`, which streams
narrow and deep matrices at a bandwidth cuBLAS's tiles for one row leave unused.

16-bit weights only: float32 models are the precise configuration the tests compare against,
and keep `F.linear`'s products. Nothing that needs a gradient takes the GEMV (it has no
backward). `MUSE_ONE_ROW_GEMV=0` in the environment keeps every product on `F.linear` (to
measure the GEMV against it).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

GEMV_DTYPES = (torch.bfloat16, torch.float16)
GEMV_ON = os.environ.get("MUSE_ONE_ROW_GEMV", "1") != "0"


def takes_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `dense_linear` runs the one-row GEMV for these operands."""
    one_row = x.numel() == x.shape[-1]
    return (GEMV_ON and x.is_cuda and one_row and weight.dim() == 2
            and x.shape[-1] == weight.shape[1] and weight.shape[0] > 0
            and x.dtype == weight.dtype and x.dtype in GEMV_DTYPES and weight.stride(1) == 1
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """F.linear(x, weight, bias), x [..., in] -> [..., out]."""
    if takes_gemv(x, weight):
        from muse.kernels.gemv_triton import dense_gemv

        return dense_gemv(x.reshape(-1), weight, bias).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)
