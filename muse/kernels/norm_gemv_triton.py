"""A one-row GEMV whose input is normalised in its own prologue: y = W @ rms_norm(x + r).

In a batch-1 decode step each RMSNorm of a layer (before attention, before the MLP) is a
kernel of its own whose only reader is the projection after it, and on the H200 each kernel
boundary costs a wait for the one before plus a first dependent load, for a row the GPU
reads in well under a microsecond. Here every GEMV program computes the norm of the whole
row itself (a few KB from L2, the same values in every program) and multiplies its weight
rows by it, so the norm's launch and its round trip through memory go. Program (0, 0) also
stores the residual sum and the normed row, for the layers that read them (the experts of
an MoE without a latent projection, the next layer's residual).

Same rounding points as the two kernels it replaces (`norms_triton` then `gemv_triton`):
the residual sum rounded to the input dtype, normalised in float32, times the norm weight
and rounded to the input dtype, then multiplied by the weights with float32 sums. The twin
is `add_rms_norm_torch` (or `rms_norm_torch`) followed by `F.linear`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muse.kernels.gemv_triton import (GemvTiles, choose_dense_gemv_tiles, gemv_launch,
                                      gemv_outputs, store_gemv_output)
from muse.kernels.pdl import start_dependent_kernel


@triton.jit
def _summed_slice(x_ptr, r_ptr, k_start, ks, K: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """x + r over [k_start, k_start + BLOCK_K), rounded to x's dtype (as the norm kernel
    stores it), in float32; zeros past K."""
    k_ok = k_start + ks < K
    x = tl.load(x_ptr + k_start + ks, mask=k_ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + k_start + ks, mask=k_ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    return x.to(tl.float32)


@triton.jit
def _normed_slice(x_ptr, r_ptr, nw_ptr, rstd, k_start, ks, K: tl.constexpr,
                  HAS_RESIDUAL: tl.constexpr):
    """rms_norm(x + r) over one BLOCK_K slice, rounded to x's dtype, in float32."""
    k_ok = k_start + ks < K
    summed = _summed_slice(x_ptr, r_ptr, k_start, ks, K, HAS_RESIDUAL)
    nw = tl.load(nw_ptr + k_start + ks, mask=k_ok, other=0.0).to(tl.float32)
    return (nw * (summed * rstd)).to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _norm_gemv_kernel(
    x_ptr, r_ptr, nw_ptr, w_ptr, y_ptr, h_ptr, sum_ptr, partial_ptr, counter_ptr,
    N, stride_wn, eps,
    K: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_PER_PROGRAM: tl.constexpr,
    SPLIT: tl.constexpr, PDL: tl.constexpr,
):
    """y[n] = sum_k rms_norm(x + r)[k] * w[n, k] for BLOCK_N outputs over this program's K
    slice (`_dense_gemv_kernel`'s tiles), after the norm's statistic over the whole row.

    The first weight tile is loaded before the wait for the kernel before (PDL): weights are
    the one thing no kernel of a step writes."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wn
    k_first = pid_k * K_PER_PROGRAM
    w_first = tl.load(w_rows + (k_first + ks)[None, :],
                      mask=col_ok[:, None] & (k_first + ks < K)[None, :], other=0.0)
    start_dependent_kernel(PDL)

    if K <= BLOCK_K:
        # The whole row in one slice (the usual decode shapes): read it once.
        k_ok = ks < K
        nw = tl.load(nw_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
        summed = _summed_slice(x_ptr, r_ptr, 0, ks, K, HAS_RESIDUAL)
        rstd = tl.math.rsqrt(tl.sum(summed * summed, axis=0) / K + eps)
        h = (nw * (summed * rstd)).to(x_ptr.dtype.element_ty)
        if (pid_n == 0) & (pid_k == 0):
            tl.store(h_ptr + ks, h, mask=k_ok)
            if HAS_RESIDUAL:
                tl.store(sum_ptr + ks, summed.to(sum_ptr.dtype.element_ty), mask=k_ok)
        acc = w_first.to(tl.float32) * h.to(tl.float32)[None, :]
    else:
        squares = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k_start in range(0, K, BLOCK_K):
            summed = _summed_slice(x_ptr, r_ptr, k_start, ks, K, HAS_RESIDUAL)
            squares += summed * summed
        rstd = tl.math.rsqrt(tl.sum(squares, axis=0) / K + eps)
        if (pid_n == 0) & (pid_k == 0):
            for k_start in range(0, K, BLOCK_K):
                k_ok = k_start + ks < K
                h = _normed_slice(x_ptr, r_ptr, nw_ptr, rstd, k_start, ks, K, HAS_RESIDUAL)
                tl.store(h_ptr + k_start + ks, h.to(h_ptr.dtype.element_ty), mask=k_ok)
                if HAS_RESIDUAL:
                    summed = _summed_slice(x_ptr, r_ptr, k_start, ks, K, HAS_RESIDUAL)
                    tl.store(sum_ptr + k_start + ks, summed.to(sum_ptr.dtype.element_ty),
                             mask=k_ok)
        acc = w_first.to(tl.float32) * _normed_slice(x_ptr, r_ptr, nw_ptr, rstd, k_first, ks,
                                                     K, HAS_RESIDUAL)[None, :]
        for k_start in range(k_first + BLOCK_K, k_first + K_PER_PROGRAM, BLOCK_K):
            w = tl.load(w_rows + (k_start + ks)[None, :],
                        mask=col_ok[:, None] & (k_start + ks < K)[None, :], other=0.0)
            acc += w.to(tl.float32) * _normed_slice(x_ptr, r_ptr, nw_ptr, rstd, k_start, ks,
                                                    K, HAS_RESIDUAL)[None, :]
    store_gemv_output(tl.sum(acc, axis=1), cols, col_ok, N, partial_ptr, counter_ptr, y_ptr,
                      y_ptr, y_ptr, 0, 1, False, False, SPLIT)


def norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
              eps: float, weight: torch.Tensor, tiles: GemvTiles | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight @ h, h, x + residual) for one row x [in], h = rms_norm(x + residual) with
    `norm_weight`; without a residual h = rms_norm(x) and the third result is x itself.
    tiles: None picks the dense GEMV's (`choose_dense_gemv_tiles`)."""
    out_features, in_features = weight.shape
    for name, row in (("x", x), ("residual", residual), ("norm_weight", norm_weight)):
        if row is not None and (row.dim() != 1 or row.shape[0] != in_features
                                or row.stride(0) != 1):
            raise ValueError(f"norm_gemv takes contiguous rows of {in_features} for {name}, "
                             f"got {list(row.shape)}")
    if weight.stride(1) != 1:
        raise ValueError("norm_gemv needs the weight's rows contiguous")
    tiles = tiles or choose_dense_gemv_tiles(out_features, in_features)
    y, partials, counters, steps = gemv_outputs(x, out_features, in_features, tiles)
    h = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else x
    grid, launch = gemv_launch(tiles, out_features, steps, x.device)
    _norm_gemv_kernel[grid](
        x, residual if residual is not None else x, norm_weight, weight, y, h, summed,
        partials, counters, out_features, weight.stride(0), eps,
        K=in_features, HAS_RESIDUAL=residual is not None, **launch,
    )
    return y, h, summed
