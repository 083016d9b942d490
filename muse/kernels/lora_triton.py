"""Triton kernels for batched multi-LoRA (BGMV): each row reads its own adapter's weights.

Same contract and numerics as the twins in `muse.kernels.lora`. Both kernels are matrix-vector
products done with elementwise products and `tl.sum` (a row's rank is too small for
`tl.dot`'s 16-wide operands to pay), accumulated in float32:

* shrink: one program per (row, BLOCK_R ranks); it walks K in BLOCK_K steps over those rows
  of the row's adapter in `lora_a`, the last rank block masked.
* expand: one program per (row, BLOCK_N outputs); it reads the row's u once and the matching
  [BLOCK_N, R] tile of `lora_b`, adds the product to y's float32 value and rounds once.

A row whose index is -1 loads nothing (all its loads are masked off): shrink stores zeros,
expand stores nothing. Grids depend only on shapes and nothing is read back to the host, so a
decode step that contains these kernels can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muse.kernels.lora import check_expand_args, check_shrink_args

# Tiles for decode (at most DECODE_ROWS rows) and for larger batches, picked on the H200 with
# K = N = 4096, R = 16 and 64, 8 slots, timed as CUDA-graph replays. Each weight tile is a few
# thousand float32 values held in registers.
#
# Shrink: a decode step has a few rows, so one program per row would leave most SMs idle while
# it walks all of K: it runs a program per two ranks (each rereads the row of x, from cache)
# over long K steps, 1.8 us at 1 row (3.7 us with the batch tiles). Larger batches fill the GPU
# with rows and share each x tile among 8 ranks: 15 us at 1024 rows and R = 16, 51 us at 64.
# Expand: a program per row and 128 (decode) or 256 outputs, fewer at larger ranks: 1.7-2.3 us
# at 1-8 rows, 15 us at 1024 rows and R = 16, 50 us at 64 (21 and 66 with the decode tiles).
DECODE_ROWS = 16
_SHRINK_BLOCK_R = {True: 2, False: 8}
_SHRINK_TILE = 4096
_SHRINK_WARPS = {True: 8, False: 4}
_EXPAND_MAX_BLOCK_N = {True: 128, False: 256}
_EXPAND_TILE = {True: 4096, False: 8192}
_EXPAND_WARPS = {True: 4, False: 2}


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, indices_ptr, u_ptr,
                        stride_xt, stride_xk, stride_as, stride_ar, stride_ak, stride_i,
                        stride_ut, stride_ur,
                        K: tl.constexpr, RANK: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    """u[t, ranks] = a[slot, ranks] @ x[t] for this program's row t and BLOCK_R ranks (0 where
    slot is -1)."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(indices_ptr + row * stride_i).to(tl.int64)
    has_adapter = slot >= 0
    ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rank_ok = (ranks < RANK) & has_adapter
    ks = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + tl.maximum(slot, 0) * stride_as + ranks[:, None] * stride_ar
    # Summed across the tile once at the end: one reduction per row, not one per step.
    acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k = k_start + ks
        k_ok = (k < K) & has_adapter
        x = tl.load(x_ptr + row * stride_xt + k * stride_xk, mask=k_ok, other=0.0)
        a = tl.load(a_rows + k[None, :] * stride_ak, mask=rank_ok[:, None] & k_ok[None, :],
                    other=0.0)
        acc += a.to(tl.float32) * x.to(tl.float32)[None, :]
    u = tl.sum(acc, axis=1)
    tl.store(u_ptr + row * stride_ut + ranks * stride_ur, u, mask=ranks < RANK)


@triton.jit
def _lora_expand_kernel(y_ptr, u_ptr, b_ptr, indices_ptr,
                        stride_yt, stride_yn, stride_ut, stride_ur,
                        stride_bs, stride_bn, stride_br, stride_i,
                        N: tl.constexpr, RANK: tl.constexpr, RANK_PAD: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    """y[t, cols] = round(y[t, cols] + u[t] @ b[slot, cols].T) for this program's row t and
    BLOCK_N columns; nothing is stored where slot is -1."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(indices_ptr + row * stride_i).to(tl.int64)
    has_adapter = slot >= 0
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = (cols < N) & has_adapter
    ranks = tl.arange(0, RANK_PAD)
    rank_ok = (ranks < RANK) & has_adapter
    u = tl.load(u_ptr + row * stride_ut + ranks * stride_ur, mask=rank_ok, other=0.0)
    b = tl.load(b_ptr + tl.maximum(slot, 0) * stride_bs + cols[:, None] * stride_bn
                + ranks[None, :] * stride_br,
                mask=col_ok[:, None] & rank_ok[None, :], other=0.0)
    delta = tl.sum(b.to(tl.float32) * u.to(tl.float32)[None, :], axis=1)
    y_ptrs = y_ptr + row * stride_yt + cols * stride_yn
    y = tl.load(y_ptrs, mask=col_ok, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=col_ok)


def lora_shrink_triton(x: torch.Tensor, lora_a: torch.Tensor,
                       indices: torch.Tensor) -> torch.Tensor:
    """u [T, R] float32 (see `muse.kernels.lora.lora_shrink_torch`), on any device Triton runs
    on (its interpreter included). Any strides."""
    check_shrink_args(x, lora_a, indices)
    num_rows, in_features = x.shape
    rank = lora_a.shape[1]
    u = torch.empty(num_rows, rank, dtype=torch.float32, device=x.device)
    if num_rows == 0 or rank == 0:
        return u
    decode = num_rows <= DECODE_ROWS
    block_r = min(_SHRINK_BLOCK_R[decode], triton.next_power_of_2(rank))
    block_k = max(16, min(_SHRINK_TILE // block_r, triton.next_power_of_2(in_features)))
    _lora_shrink_kernel[(num_rows, triton.cdiv(rank, block_r))](
        x, lora_a, indices, u,
        x.stride(0), x.stride(1), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        indices.stride(0), u.stride(0), u.stride(1),
        K=in_features, RANK=rank, BLOCK_R=block_r, BLOCK_K=block_k,
        num_warps=_SHRINK_WARPS[decode],
    )
    return u


def lora_expand_triton(y: torch.Tensor, u: torch.Tensor, lora_b: torch.Tensor,
                       indices: torch.Tensor, out_offset: int = 0,
                       rank_offset: int = 0) -> None:
    """In place on y (see `muse.kernels.lora.lora_expand_torch`), on any device Triton runs on
    (its interpreter included). y, u and lora_b may have any strides (y may be a view)."""
    check_expand_args(y, u, lora_b, indices, out_offset, rank_offset)
    num_rows = y.shape[0]
    _, out_features, rank = lora_b.shape
    if num_rows == 0 or out_features == 0 or rank == 0:
        return
    # Views: their data pointers carry the offsets, their strides the rest.
    target = y[:, out_offset:out_offset + out_features]
    part = u[:, rank_offset:rank_offset + rank]
    rank_pad = triton.next_power_of_2(rank)
    decode = num_rows <= DECODE_ROWS
    block_n = max(16, min(_EXPAND_MAX_BLOCK_N[decode], _EXPAND_TILE[decode] // rank_pad,
                          triton.next_power_of_2(out_features)))
    grid = (num_rows, triton.cdiv(out_features, block_n))
    _lora_expand_kernel[grid](
        target, part, lora_b, indices,
        target.stride(0), target.stride(1), part.stride(0), part.stride(1),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2), indices.stride(0),
        N=out_features, RANK=rank, RANK_PAD=rank_pad, BLOCK_N=block_n,
        num_warps=_EXPAND_WARPS[decode],
    )
