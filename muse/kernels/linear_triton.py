"""The skinny matmul of `muse.kernels.linear` as a Triton kernel (see there for why)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Output columns per program, depth per loop step, warps, pipeline stages: 16 columns give
# narrow matrices enough programs (the 128-column router gets 8, a 2048-column projection
# 128), and 4 stages of 16 x 256 weight tiles keep 32 KB of loads in flight per program.
SKINNY_CONFIG = (16, 256, 4, 4)

# As in moe_triton: the interpreter multiplies bfloat16 tiles as raw words; widen them there.
_WIDEN_DOT = bool(triton.knobs.runtime.interpret)


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    """y[:, n-slab] = x @ W[n-slab]^T for all M (<= BLOCK_M) rows over the whole depth K."""
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]
    # The weight slab is read as a [K, N] view of the row-major [N, K] matrix.
    w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_ok = ks < K - k_start
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if WIDEN:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def skinny_linear(x: torch.Tensor, weight: torch.Tensor,
                  config: tuple[int, int, int, int] = SKINNY_CONFIG) -> torch.Tensor:
    """x [M <= 16, K] @ weight [N, K]^T -> [M, N] in x.dtype (float32 accumulation)."""
    num_rows, depth = x.shape
    width = weight.shape[0]
    assert weight.shape[1] == depth and weight.stride(1) == 1 and num_rows <= 16
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(num_rows, width, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = config
    block_k = max(16, min(block_k, triton.next_power_of_2(depth)))
    _skinny_kernel[(triton.cdiv(width, block_n),)](
        x, weight, y, num_rows, width, depth, x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
        # float32 models are the precise configuration: no TF32 in their products.
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", WIDEN=_WIDEN_DOT,
        num_warps=warps, num_stages=stages)
    return y
