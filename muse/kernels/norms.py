"""RMSNorm and the fused residual add + RMSNorm, as Triton kernels with PyTorch twins.

The math follows `muse.reference.layers.rms_norm`: the row is normalised in float32,
multiplied by the float32 weight and rounded once to the input dtype. `add_rms_norm` first
forms the residual sum in the input dtype (as the reference's `x = x + attn` does) and
normalises that rounded sum, so its two results are exactly what the unfused code would see.

The Triton path is taken for CUDA tensors; everything else (CPU, tests without a GPU) uses the
twin. Both launch a fixed amount of work with no host synchronisation, so they can be captured
in a CUDA graph. The Triton sum of squares is reduced in a different order from torch's, so
float32 results agree to a few ulps rather than bit for bit; the twins are bit-identical.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any, Callable

import torch

# Triton is optional (the twins cover every device) and imported at the first launch, not with
# this module: its import fixes whether its own helpers are compiled or interpreted
# (TRITON_INTERPRET), and CPU-only processes need not pay for it.
HAS_TRITON = importlib.util.find_spec("triton") is not None
triton: Any = None
tl: Any = None


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, in float32, returned in x.dtype (the reference ops)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * normed).to(x.dtype)


def add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum rounded to x.dtype first."""
    summed = (x + residual).to(x.dtype)
    return rms_norm_torch(summed, weight, eps), summed


@functools.cache
def _jit(fn: Callable) -> Callable:
    """`fn` as a Triton kernel, importing Triton into this module's globals on first use."""
    global triton, tl
    import triton
    import triton.language as tl
    return triton.jit(fn)


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


# A Triton kernel, decorated by `_jit` at its first launch.
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr,
                     x_stride, r_stride, out_stride, sum_stride, n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    # One program per row; BLOCK covers the whole row, so one pass reads it once.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * r_stride + cols, mask=mask, other=0.0)
        # Round the sum to the input dtype before normalising, as the unfused code does.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * sum_stride + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=0) / n_cols
    normed = x32 * tl.math.rsqrt(mean_square + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (w * normed).to(out_ptr.dtype.element_ty),
             mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, cols] with unit column stride; a view whenever the layout allows one."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not HAS_TRITON:
        raise RuntimeError("the Triton norm kernels need the `triton` package")
    x2 = _rows(x)
    n_rows, n_cols = x2.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, n_cols)
    r2, summed, sum2 = x2, None, out2  # placeholders when there is no residual
    if residual is not None:
        r2 = _rows(residual)
        summed = torch.empty_like(out)
        sum2 = summed.view(-1, n_cols)
    if n_rows:
        block = _next_power_of_2(n_cols)
        _jit(_rms_norm_kernel)[(n_rows,)](
            x2, r2, weight.contiguous(), out2, sum2,
            x2.stride(0), r2.stride(0), out2.stride(0), sum2.stride(0), n_cols, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block,
            # Wide rows get more warps so each thread holds a bounded slice of the row.
            num_warps=max(1, min(16, block // 256)))
    return out, summed


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Triton kernel on any device Triton can run on (the interpreter included)."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused Triton kernel: (rms_norm(x + residual), x + residual)."""
    out, summed = _launch(x, residual.expand_as(x), weight, eps)
    assert summed is not None
    return out, summed


def _use_triton(x: torch.Tensor) -> bool:
    return HAS_TRITON and x.is_cuda


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: float32 math, result in x.dtype."""
    return rms_norm_triton(x, weight, eps) if _use_triton(x) else rms_norm_torch(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, summed): summed = x + residual in x.dtype, normed = rms_norm(summed)."""
    if _use_triton(x):
        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_torch(x, residual, weight, eps)
