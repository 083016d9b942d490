"""A layer's input norm and the projection that reads it, for a one-row step.

`norm_linear` gives rms_norm(x + residual) @ W^T together with the normed row and the new
residual. For one 16-bit row on a GPU (batch-1 decode) with `MUSE_NORM_GEMV=1` it is one
kernel (`muse.kernels.norm_gemv_triton`: the norm in the GEMV's prologue); otherwise the
backend's norm followed by `dense_linear`, the same values through two launches. Off by
default until it is timed on the H200 against the two launches it replaces.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from muse.kernels.dense_linear import dense_linear, takes_gemv

NORM_GEMV_ON = os.environ.get("MUSE_NORM_GEMV", "0") == "1"


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                eps: float, weight: torch.Tensor, rms_norm: Callable, add_rms_norm: Callable
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h @ weight^T, h, x + residual) with h = rms_norm(x + residual); without a residual
    h = rms_norm(x) and the last result is x. x [rows, in]; `rms_norm` / `add_rms_norm` are
    the backend's norms, used unless the fused kernel runs."""
    if NORM_GEMV_ON and x.shape[0] == 1 and takes_gemv(x, weight):
        from muse.kernels.norm_gemv_triton import norm_gemv

        row = x.reshape(-1)
        res = residual.reshape(-1) if residual is not None else None
        if row.stride(0) == 1 and (res is None or res.stride(0) == 1):
            y, h, summed = norm_gemv(row, res, norm_weight, eps, weight)
            return y.view(1, -1), h.view(x.shape), summed.view(x.shape)
    if residual is None:
        h, summed = rms_norm(x, norm_weight, eps), x
    else:
        h, summed = add_rms_norm(x, residual, norm_weight, eps)
    return dense_linear(h, weight), h, summed
