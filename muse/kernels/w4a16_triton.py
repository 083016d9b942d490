"""Triton W4A16 GEMM on FP4 weights (NVFP4, MXFP4): the packed bytes and block scales are
read and turned into the activation-dtype weight tile in registers. See `muse.kernels.w4a16`
for the format and the numerics; `fp4_weight_tiles` is shared with the fused experts
(`muse.kernels.moe_triton`).

Each K step of BLOCK_K inputs reads a [BLOCK_K / block, block / 2, BLOCK_N] tile of packed
bytes, so a scale broadcasts over its block without any gather, and splits it into two
[BLOCK_K / 2, BLOCK_N] weight tiles: the even inputs (low nibbles) and the odd ones (high
nibbles). The activations are read as one contiguous tile and split into the matching even
and odd columns, and the GEMM is two `tl.dot`s, so the nibbles are never interleaved back into
input order. The scales are read as bytes: E4M3 bitcast to float8 and widened, E8M0 made a
float32 exponent field.

E2M1 to float without a table: a nibble's sign bit and its three exponent-mantissa bits are
moved into the sign and the low exponent / top mantissa bits of a float16, whose value is
then exactly the E2M1 value times 2^-14 (the E2M1 subnormal 0.5 lands on the float16
subnormal 2^-15); the 2^14 is folded into the block scale, exactly. The product e2m1 * scale
is exact in float32, so the tile is rounded once by the row factor and once to the
activation dtype, as the twin rounds it.

Launches depend only on shapes and a few tensors, and nothing is read back to the host, so a
decode step that contains the kernel can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from muse.kernels.gemv_triton import (GemvTiles, check_split, gemv_launch, gemv_outputs,
                                      split_for, store_gemv_output)
from muse.kernels.pdl import start_dependent_kernel
from muse.kernels.w4a16 import Fp4Weight

# Triton's interpreter multiplies bfloat16 tiles as raw uint16 words; under it the dot operands
# are widened to float32 first (exact for 16-bit floats, and the accumulation is float32 anyway).
_WIDEN_DOT = bool(triton.knobs.runtime.interpret)

# 2^14: the float16 made of an E2M1 nibble's bits is its value times 2^-14.
_E2M1_FOLD = tl.constexpr(16384.0)


@dataclass(frozen=True)
class LinearTiles:
    block_m: int
    block_n: int
    block_k: int  # a multiple of the scale block, at least 32 (two dots of K >= 16)
    num_warps: int
    num_stages: int
    split_k: int = 1  # programs sharing each output tile's K (partial sums added after)


def choose_tiles(num_rows: int, out_features: int, in_features: int,
                 dtype: torch.dtype = torch.bfloat16) -> LinearTiles:
    """Tiles for H100/H200-class GPUs from the number of activation rows M.

    Decode (M <= 16): the kernel streams the weight through 16-row blocks (the smallest
    tl.dot takes) in narrow 16 x 128 tiles, one warp each (the warps of a 16-row dot split
    the columns; on a 16-column tile more warps would repeat each other's dequantization),
    spread over many programs, split along K where the output tiles are few (`split_for`).
    That was the fastest of the swept decode tiles on the H200 (12.5-13 us for the 15B
    shape's qkv_proj and o_proj at M = 1-8; bf16 F.linear 8.5-9.7 us: the FP4 GEMM is not
    yet faster than bf16 at decode). Larger M reuses each dequantized tile over more rows.
    Float32 activations (the precise reference configuration: full-precision dots without
    tensor cores) take small tiles, which the compiler keeps in registers.
    `benchmarks/w4a16_gemm.py --sweep-tiles` times alternatives.
    """
    if dtype == torch.float32:
        tiles = LinearTiles(16 if num_rows <= 16 else 32, 32, 64, 4, 2)
    elif num_rows <= 16:
        tiles = LinearTiles(16, 16, 128, 1, 4)
    elif num_rows <= 32:
        tiles = LinearTiles(32, 64, 128, 4, 4)
    elif num_rows <= 64:
        tiles = LinearTiles(64, 64, 128, 4, 4)
    else:
        tiles = LinearTiles(128, 128, 64, 8, 3)
    block_k = max(32, min(tiles.block_k, triton.next_power_of_2(in_features)))
    block_n = max(16, min(tiles.block_n, triton.next_power_of_2(out_features)))
    programs = triton.cdiv(num_rows, tiles.block_m) * triton.cdiv(out_features, block_n)
    split_k = split_for(programs, triton.cdiv(in_features, block_k))
    return LinearTiles(tiles.block_m, block_n, block_k, tiles.num_warps, tiles.num_stages,
                       split_k)


@triton.jit
def folded_scales(scale, SCALE_E8M0: tl.constexpr):
    """Scale bytes (E4M3, or E8M0 exponents) -> float32 scales times 2^14, the factor that
    `e2m1_halves`' float16 values lack."""
    if SCALE_E8M0:
        # 2^(s - 127) * 2^14 built as a float32 exponent field, exactly (scales above 2^113,
        # weights beyond 1e34, would overflow to inf); 255 is NaN.
        exponent = tl.minimum(scale.to(tl.int32) + 14, 255)
        folded = (exponent << 23).to(tl.float32, bitcast=True)
        return tl.where(scale.to(tl.int32) == 255, float("nan"), folded)
    return scale.to(tl.float8e4nv, bitcast=True).to(tl.float32) * _E2M1_FOLD


@triton.jit
def e2m1_halves(packed):
    """Packed bytes (widened to uint16) -> (low nibbles, high nibbles) as float16 values
    2^-14 times their E2M1 values: each nibble's sign and three value bits moved into place."""
    even = ((packed & 0x8) << 12) | ((packed & 0x7) << 9)
    odd = ((packed & 0x80) << 8) | ((packed & 0x70) << 5)
    return even.to(tl.float16, bitcast=True), odd.to(tl.float16, bitcast=True)


@triton.jit
def fp4_weight_tiles(packed_ptr, scales_ptr, rows, row_ok, row_factor, k_start,
                     stride_pn, stride_pk, stride_sn, stride_sk,
                     K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SCALE_BLOCK: tl.constexpr, SCALE_E8M0: tl.constexpr,
                     HAS_ROW_FACTOR: tl.constexpr):
    """Inputs k_start .. k_start + BLOCK_K of weight rows `rows` [BLOCK_N], in float32, as two
    [BLOCK_K / 2, BLOCK_N] tiles: the even inputs and the odd ones.

    packed_ptr / scales_ptr point at the weight's [out, in/2] bytes and [out, in/block]
    scales (an expert's, for stacked experts); row_factor [BLOCK_N] is used when
    HAS_ROW_FACTOR. K, a multiple of SCALE_BLOCK, masks whole blocks; rows past the end load
    zeros. The caller rounds the tiles to its activation dtype.
    """
    GROUPS: tl.constexpr = BLOCK_K // SCALE_BLOCK
    HALF: tl.constexpr = SCALE_BLOCK // 2  # packed bytes per scale
    groups = k_start // SCALE_BLOCK + tl.arange(0, GROUPS)
    mask = (groups < K // SCALE_BLOCK)[:, None] & row_ok[None, :]
    scale = folded_scales(tl.load(scales_ptr + rows[None, :] * stride_sn
                                  + groups[:, None] * stride_sk, mask=mask, other=0),
                          SCALE_E8M0)
    byte_cols = groups[:, None, None] * HALF + tl.arange(0, HALF)[None, :, None]
    packed = tl.load(packed_ptr + rows[None, None, :] * stride_pn + byte_cols * stride_pk,
                     mask=mask[:, None, :], other=0).to(tl.uint16)
    even, odd = e2m1_halves(packed)
    even = even.to(tl.float32) * scale[:, None, :]
    odd = odd.to(tl.float32) * scale[:, None, :]
    if HAS_ROW_FACTOR:
        even = even * row_factor[None, None, :]
        odd = odd * row_factor[None, None, :]
    return (tl.reshape(even, (BLOCK_K // 2, BLOCK_N)),
            tl.reshape(odd, (BLOCK_K // 2, BLOCK_N)))


@triton.jit
def even_odd_columns(x_ptr, rows, row_ok, ks, stride_xm, stride_xk, K: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Columns ks (BLOCK_K consecutive inputs) of activation rows `rows`, split into the even
    and the odd ones, [BLOCK_M, BLOCK_K / 2] each. Loaded as one contiguous tile, so the
    load is vectorised and pipelined like the weight's."""
    x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                mask=row_ok[:, None] & (ks < K)[None, :], other=0.0)
    return tl.split(tl.reshape(x, (BLOCK_M, BLOCK_K // 2, 2)))


@triton.jit
def _w4a16_linear_kernel(
    x_ptr, packed_ptr, scales_ptr, row_factor_ptr, bias_ptr, y_ptr,
    M, N,
    stride_xm, stride_xk, stride_pn, stride_pk, stride_sn, stride_sk, stride_rn,
    stride_ym, stride_yn,
    K: tl.constexpr, SCALE_BLOCK: tl.constexpr, SCALE_E8M0: tl.constexpr,
    HAS_ROW_FACTOR: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_PER_PROGRAM: tl.constexpr, PARTIAL: tl.constexpr,
    PRECISION: tl.constexpr, WIDEN: tl.constexpr,
):
    """y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for one BLOCK_M x BLOCK_N tile, over the
    K_PER_PROGRAM inputs of this program's K slice (grid axis 2). PARTIAL: the slices' float32
    sums go to y[slice] (a [split, M, N] buffer; the caller adds them), else y is the result.

    K is a compile-time constant (fixed per layer); M and N are not (M changes every step).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    row_factor = 1.0
    if HAS_ROW_FACTOR:
        row_factor = tl.load(row_factor_ptr + cols * stride_rn, mask=col_ok,
                             other=1.0).to(tl.float32)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_first = pid_k * K_PER_PROGRAM
    for k_start in range(k_first, k_first + K_PER_PROGRAM, BLOCK_K):
        x_even, x_odd = even_odd_columns(x_ptr, rows, row_ok, k_start + ks, stride_xm,
                                         stride_xk, K, BLOCK_M, BLOCK_K)
        even, odd = fp4_weight_tiles(packed_ptr, scales_ptr, cols, col_ok, row_factor, k_start,
                                     stride_pn, stride_pk, stride_sn, stride_sk,
                                     K, BLOCK_N, BLOCK_K, SCALE_BLOCK, SCALE_E8M0,
                                     HAS_ROW_FACTOR)
        even = even.to(x_ptr.dtype.element_ty)
        odd = odd.to(x_ptr.dtype.element_ty)
        if WIDEN:
            x_even, x_odd = x_even.to(tl.float32), x_odd.to(tl.float32)
            even, odd = even.to(tl.float32), odd.to(tl.float32)
        acc = tl.dot(x_even, even, acc, input_precision=PRECISION)
        acc = tl.dot(x_odd, odd, acc, input_precision=PRECISION)

    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn
    if PARTIAL:
        y_ptrs += pid_k * M * N
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def choose_gemv_tiles(out_features: int, in_features: int, block: int) -> GemvTiles:
    """Tiles of the one-row kernel: 32 output rows x 256 inputs a step, four warps, split
    along K until there are enough programs (`split_for`). A first choice, to be swept on the
    H200 (`benchmarks/w4a16_gemm.py --sweep-tiles`)."""
    block_k = max(block, min(256, triton.next_power_of_2(in_features)))
    block_n = max(16, min(32, triton.next_power_of_2(out_features)))
    split = split_for(triton.cdiv(out_features, block_n), triton.cdiv(in_features, block_k))
    return GemvTiles(block_n, block_k, 4, split)


@triton.jit
def fp4_gemv_step(x_ptr, stride_xk, packed_ptr, scales_ptr, rows, row_ok, k_start,
                  stride_pn, stride_pk, stride_sn, stride_sk, K: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_BLOCK: tl.constexpr,
                  SCALE_E8M0: tl.constexpr):
    """One K step of a GEMV on an FP4 weight, without `tl.dot`: for weight rows `rows`
    [BLOCK_N] and inputs k_start .. k_start + BLOCK_K, each scale block's sum of
    e2m1 * x times the block's scale, [BLOCK_N, BLOCK_K / SCALE_BLOCK] float32 (summed over
    the steps and the blocks by the caller, who then applies the row factor).

    A decode GEMV reads each weight once, so the work per weight bounds it: each nibble
    becomes a float16 (`e2m1_halves`: two integer ops and a bitcast), is widened
    and multiplied into the products with x; the scale costs one multiply per block. x_ptr
    points at the activation row (inputs at stride_xk)."""
    GROUPS: tl.constexpr = BLOCK_K // SCALE_BLOCK
    HALF: tl.constexpr = SCALE_BLOCK // 2  # packed bytes per scale
    groups = k_start // SCALE_BLOCK + tl.arange(0, GROUPS)
    group_ok = groups < K // SCALE_BLOCK
    mask = row_ok[:, None] & group_ok[None, :]
    scale = folded_scales(tl.load(scales_ptr + rows[:, None] * stride_sn
                                  + groups[None, :] * stride_sk, mask=mask, other=0),
                          SCALE_E8M0)
    byte_cols = groups[None, :, None] * HALF + tl.arange(0, HALF)[None, None, :]
    packed = tl.load(packed_ptr + rows[:, None, None] * stride_pn + byte_cols * stride_pk,
                     mask=mask[:, :, None], other=0).to(tl.uint16)
    even, odd = e2m1_halves(packed)
    # x's even and odd inputs of each scale block, [GROUPS, HALF] each.
    ks = groups[:, None] * SCALE_BLOCK + 2 * tl.arange(0, HALF)[None, :]
    x_even = tl.load(x_ptr + ks * stride_xk, mask=group_ok[:, None], other=0.0)
    x_odd = tl.load(x_ptr + (ks + 1) * stride_xk, mask=group_ok[:, None], other=0.0)
    products = (even.to(tl.float32) * x_even.to(tl.float32)[None, :, :]
                + odd.to(tl.float32) * x_odd.to(tl.float32)[None, :, :])
    return tl.sum(products, axis=2) * scale


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr, packed_ptr, scales_ptr, row_factor_ptr, bias_ptr, y_ptr, partial_ptr, counter_ptr,
    N, stride_xk, stride_pn, stride_pk, stride_sn, stride_sk, stride_rn, stride_yn,
    K: tl.constexpr, SCALE_BLOCK: tl.constexpr, SCALE_E8M0: tl.constexpr,
    HAS_ROW_FACTOR: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_PER_PROGRAM: tl.constexpr,
    SPLIT: tl.constexpr, PDL: tl.constexpr,
):
    """y[n] = sum_k x[k] * w[n, k] (+ bias[n]) for one activation row and BLOCK_N outputs, over
    this program's K slice (`fp4_gemv_step`); the row factor multiplies each output's sum
    once. The twin rounds each weight to the activation dtype first: the results differ by
    that rounding, well inside the tests' tolerance. K may be split over programs (grid axis
    1), whose partial sums `store_gemv_output` adds in the same launch."""
    start_dependent_kernel(PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros((BLOCK_N, BLOCK_K // SCALE_BLOCK), dtype=tl.float32)
    k_first = tl.program_id(1) * K_PER_PROGRAM
    for k_start in range(k_first, k_first + K_PER_PROGRAM, BLOCK_K):
        acc += fp4_gemv_step(x_ptr, stride_xk, packed_ptr, scales_ptr, cols, col_ok, k_start,
                             stride_pn, stride_pk, stride_sn, stride_sk, K, BLOCK_N, BLOCK_K,
                             SCALE_BLOCK, SCALE_E8M0)
    store_gemv_output(tl.sum(acc, axis=1), cols, col_ok, N, partial_ptr, counter_ptr,
                      row_factor_ptr, bias_ptr, y_ptr, stride_rn, stride_yn, HAS_ROW_FACTOR,
                      HAS_BIAS, SPLIT)


def w4a16_gemv(x: torch.Tensor, weight: Fp4Weight, bias: torch.Tensor | None = None,
               tiles: GemvTiles | None = None) -> torch.Tensor:
    """y [out] = x [in] @ w.T (+ bias) for one activation row, in x's dtype (see
    `_w4a16_gemv_kernel`); tiles: None picks them (`choose_gemv_tiles`)."""
    out_features, in_features = weight.shape
    if x.dim() != 1 or x.shape[0] != in_features:
        raise ValueError(f"w4a16_gemv takes one row of {in_features} inputs, got "
                         f"{list(x.shape)}")
    tiles = tiles or choose_gemv_tiles(out_features, in_features, weight.block)
    if tiles.block_k % weight.block:
        raise ValueError(f"block_k {tiles.block_k} must be a multiple of the scale block "
                         f"{weight.block}")
    y, partials, counters, steps = gemv_outputs(x, out_features, in_features, tiles)
    scales, row_factor = weight.scale_bytes, weight.row_factor
    has_row_factor = row_factor is not None
    if row_factor is None:
        row_factor = scales  # any pointer; never read
    grid, launch = gemv_launch(tiles, out_features, steps, x.device)
    _w4a16_gemv_kernel[grid](
        x, weight.packed, scales, row_factor, bias if bias is not None else y, y, partials,
        counters, out_features, x.stride(0), weight.packed.stride(0), weight.packed.stride(1),
        scales.stride(0), scales.stride(1), row_factor.stride(0), y.stride(0),
        K=in_features, SCALE_BLOCK=weight.block, SCALE_E8M0=weight.scale_is_e8m0,
        HAS_ROW_FACTOR=has_row_factor, HAS_BIAS=bias is not None, **launch,
    )
    return y


def dot_precision(dtype: torch.dtype) -> str:
    """Float32 activations are the precise configuration: no TF32 in their dots."""
    return "ieee" if dtype == torch.float32 else "tf32"


def w4a16_linear(x: torch.Tensor, weight: Fp4Weight, bias: torch.Tensor | None = None,
                 tiles: LinearTiles | None = None) -> torch.Tensor:
    """y [..., out] = x [..., in] @ w.T (+ bias), in x's dtype (see `muse.kernels.w4a16`).

    tiles: None picks them from the shapes (`choose_tiles`), and one row takes the GEMV
    (`w4a16_gemv`); given, the GEMM runs with them (tuning).
    """
    if weight.packed.dim() != 2:
        raise ValueError(f"w4a16_linear takes a [out, in] weight, got {list(weight.shape)}")
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {in_features}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    x2 = x.reshape(-1, in_features)
    num_rows = x2.shape[0]
    if num_rows == 1 and tiles is None and out_features:  # batch-1 decode: the GEMV
        return w4a16_gemv(x2[0], weight, bias).view(*x.shape[:-1], out_features)
    y = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype, device=x.device)
    if num_rows == 0 or out_features == 0:
        return y
    y2 = y.view(num_rows, out_features)
    tiles = tiles or choose_tiles(num_rows, out_features, in_features, x.dtype)
    if tiles.block_k % weight.block or tiles.block_k < 32:
        raise ValueError(f"block_k {tiles.block_k} must be a multiple of the scale block "
                         f"{weight.block} and at least 32")
    scales = weight.scale_bytes
    row_factor = weight.row_factor
    has_row_factor = row_factor is not None
    if row_factor is None:
        row_factor = scales  # any pointer; never read
    split = tiles.split_k
    steps = triton.cdiv(in_features, tiles.block_k)
    check_split(split, steps)
    # Split-K: each program's float32 partial sum of one K slice, added up below (bias too).
    out = y2 if split == 1 else torch.empty(split, num_rows, out_features,
                                            dtype=torch.float32, device=x.device)
    has_bias = bias is not None and split == 1
    grid = (triton.cdiv(num_rows, tiles.block_m), triton.cdiv(out_features, tiles.block_n),
            split)
    _w4a16_linear_kernel[grid](
        x2, weight.packed, scales, row_factor, bias if has_bias else y2, out,
        num_rows, out_features,
        x2.stride(0), x2.stride(1), weight.packed.stride(0), weight.packed.stride(1),
        scales.stride(0), scales.stride(1), row_factor.stride(0),
        out.stride(-2), out.stride(-1),
        K=in_features, SCALE_BLOCK=weight.block, SCALE_E8M0=weight.scale_is_e8m0,
        HAS_ROW_FACTOR=has_row_factor, HAS_BIAS=has_bias,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        K_PER_PROGRAM=triton.cdiv(steps, split) * tiles.block_k, PARTIAL=split > 1,
        PRECISION=dot_precision(x.dtype), WIDEN=_WIDEN_DOT,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    if split > 1:
        total = out.sum(0)
        if bias is not None:
            total += bias.float()
        y2.copy_(total)
    return y
