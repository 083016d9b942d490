"""RMSNorm and the fused residual add + RMSNorm as one Triton kernel.

Same contracts and rounding points as the twins in `muse.kernels.norms`: with a residual the
kernel stores the sum rounded to the input dtype and normalises that rounded sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muse.kernels.pdl import pdl_options, start_dependent_kernel


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr,
                     x_stride, r_stride, out_stride, sum_stride, n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # One program per row; BLOCK covers the whole row, so one pass reads it once.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # before the wait (PDL)
    start_dependent_kernel(PDL)
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * r_stride + cols, mask=mask, other=0.0)
        # Round the sum to the input dtype before normalising, as the unfused code does.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * sum_stride + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=0) / n_cols
    normed = x32 * tl.math.rsqrt(mean_square + eps)
    tl.store(out_ptr + row * out_stride + cols, (w * normed).to(out_ptr.dtype.element_ty),
             mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, cols] with unit column stride; a view whenever the layout allows one."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
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
        block = triton.next_power_of_2(n_cols)
        _rms_norm_kernel[(n_rows,)](
            x2, r2, weight.contiguous(), out2, sum2,
            x2.stride(0), r2.stride(0), out2.stride(0), sum2.stride(0), n_cols, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, **pdl_options(x.device),
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
