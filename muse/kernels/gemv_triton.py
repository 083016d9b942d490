"""One-row GEMVs: y = x @ W^T for a single activation row (batch-1 decode), in Triton.

A batch-1 decode step multiplies one activation row by every projection of every layer, so
each product streams a weight matrix through the GPU with almost no arithmetic. cuBLAS picks
tiles for some of these shapes that leave HBM bandwidth unused: a handful of programs for a
narrow matrix such as a router's 128-256 columns (10.6 us for the 15B shape's 1 MB router,
which the copy bandwidth moves in 0.25 us), split-K with a separate reduce kernel for deep
ones (o_proj). Here each program reads BLOCK_N whole weight rows over its share of K, with
wide contiguous loads and float32 products summed in registers (no `tl.dot`: one row would
use a sixteenth of a tensor-core tile); where the output tiles are too few to keep the GPU's
loads in flight, K is split over programs too (`split_for`) and the last program of each
output tile to arrive adds the partial sums, in split order, in the same launch
(`store_gemv_output`). The FP4 GEMV of `muse.kernels.w4a16_triton` shares that machinery.

Launches depend only on shapes, and nothing is read back to the host, so a decode step that
contains them can be captured in a CUDA graph. The twin is `F.linear`: both multiply the
same bf16 values with float32 sums, in different orders.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from muse.kernels.pdl import pdl_options, start_dependent_kernel

# Split-K for products of fewer output tiles than SPLIT_BELOW, up to TARGET_PROGRAMS programs:
# measured on the H200 (`benchmarks/w4a16_gemm.py --sweep-tiles`, decode tiles 16 x 16 x 128,
# one warp), o_proj's 128 tiles ran best split 8 ways and qkv_proj's 320 unsplit.
SPLIT_BELOW = 256
TARGET_PROGRAMS = 1024


def split_for(programs: int, k_blocks: int) -> int:
    """How many programs share each output tile's K (split-K), so that a product of few
    output tiles (decode: one 16-row block of M, a hundred-odd N tiles) still has enough
    weight loads in flight; each takes whole BLOCK_K steps. 1 when the tiles alone are
    enough."""
    if programs >= SPLIT_BELOW:
        return 1
    split = min(k_blocks, triton.cdiv(TARGET_PROGRAMS, programs))
    # Equal whole steps per program, and no program left without one.
    steps = triton.cdiv(k_blocks, split)
    return triton.cdiv(k_blocks, steps)


@dataclass(frozen=True)
class GemvTiles:
    block_n: int
    block_k: int
    num_warps: int
    split_k: int = 1
    num_stages: int = 3  # Triton's default on CUDA, what the FP4 GEMV was measured with


def check_split(split: int, steps: int) -> None:
    if split < 1 or triton.cdiv(steps, triton.cdiv(steps, split)) != split:
        raise ValueError(f"split_k {split} must share the {steps} K steps with none idle")


def gemv_outputs(x: torch.Tensor, out_features: int, in_features: int, tiles: GemvTiles
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A GEMV's output, its split partial sums and arrival counters (the output itself where
    K is not split: never read then), and its number of BLOCK_K steps."""
    steps = triton.cdiv(in_features, tiles.block_k)
    check_split(tiles.split_k, steps)
    y = torch.empty(out_features, dtype=x.dtype, device=x.device)
    if tiles.split_k == 1:
        return y, y, y, steps
    partials = torch.empty(tiles.split_k, out_features, dtype=torch.float32, device=x.device)
    counters = split_counters(x.device, triton.cdiv(out_features, tiles.block_n))
    return y, partials, counters, steps


def gemv_launch(tiles: GemvTiles, out_features: int, steps: int, device: torch.device
                ) -> tuple[tuple[int, int], dict[str, int | bool]]:
    """The grid of a one-row GEMV kernel (output tiles x K splits) and the tile and launch
    arguments every such kernel takes, for `steps` BLOCK_K steps of K."""
    grid = (triton.cdiv(out_features, tiles.block_n), tiles.split_k)
    return grid, dict(BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                      K_PER_PROGRAM=triton.cdiv(steps, tiles.split_k) * tiles.block_k,
                      SPLIT=tiles.split_k, num_warps=tiles.num_warps,
                      num_stages=tiles.num_stages, **pdl_options(device))


# Arrival counters of split GEMVs, per device: zero between calls (each call's last program
# of a tile sets its counter back), so one buffer serves every call on a stream in turn. A
# buffer outgrown is kept: CUDA graphs captured with it still point at it.
_SPLIT_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    buffers = _SPLIT_COUNTERS.setdefault(device, [])
    if not buffers or buffers[-1].numel() < tiles:
        # Made before any CUDA graph capture in practice (warm-up runs eagerly first), and
        # large enough that a later, wider call rarely needs a new one.
        buffers.append(torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device))
    return buffers[-1]


@triton.jit
def _finish_gemv(out, cols, col_ok, row_factor_ptr, bias_ptr, y_ptr, stride_rn, stride_yn,
                 HAS_ROW_FACTOR: tl.constexpr, HAS_BIAS: tl.constexpr):
    if HAS_ROW_FACTOR:
        out *= tl.load(row_factor_ptr + cols * stride_rn, mask=col_ok, other=1.0).to(tl.float32)
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + cols * stride_yn, out.to(y_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def store_gemv_output(out, cols, col_ok, N, partial_ptr, counter_ptr, row_factor_ptr, bias_ptr,
                      y_ptr, stride_rn, stride_yn, HAS_ROW_FACTOR: tl.constexpr,
                      HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
    """Write this program's float32 sums `out` [BLOCK_N] of outputs `cols`, times the row
    factor and plus the bias.

    With SPLIT programs along K (grid axis 1), each stores its partial sums (float32
    [SPLIT, N] at partial_ptr) and counts itself in at its output tile's counter; the last to
    arrive adds the partials in split order (the same sums whichever arrives last), finishes
    the tile and sets the counter back to 0 for the next call. One launch, where a reduction
    after the kernel took two more (a third of a decode GEMV's time on the H200)."""
    if SPLIT > 1:
        pid_n = tl.program_id(0)
        tl.store(partial_ptr + tl.program_id(1) * N + cols, out, mask=col_ok)
        # acq_rel: this program's partials are visible before its arrival is; the last one
        # sees every partial stored before the arrivals it counts.
        arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT - 1:
            total = tl.zeros_like(out)
            for split in range(SPLIT):
                total += tl.load(partial_ptr + split * N + cols, mask=col_ok, other=0.0,
                                 cache_modifier=".cg")
            _finish_gemv(total, cols, col_ok, row_factor_ptr, bias_ptr, y_ptr, stride_rn,
                         stride_yn, HAS_ROW_FACTOR, HAS_BIAS)
            tl.atomic_xchg(counter_ptr + pid_n, 0)
    else:
        _finish_gemv(out, cols, col_ok, row_factor_ptr, bias_ptr, y_ptr, stride_rn, stride_yn,
                     HAS_ROW_FACTOR, HAS_BIAS)


@triton.jit
def _weight_tile(w_rows, col_ok, k_start, ks, K: tl.constexpr):
    k_ok = k_start + ks < K
    return tl.load(w_rows + (k_start + ks)[None, :], mask=col_ok[:, None] & k_ok[None, :],
                   other=0.0)


@triton.jit
def _x_slice(x_ptr, stride_xk, k_start, ks, K: tl.constexpr):
    return tl.load(x_ptr + (k_start + ks) * stride_xk, mask=k_start + ks < K,
                   other=0.0).to(tl.float32)[None, :]


@triton.jit
def _dense_gemv_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, partial_ptr, counter_ptr,
    N, stride_xk, stride_wn, stride_yn,
    K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_PER_PROGRAM: tl.constexpr,
    SPLIT: tl.constexpr, PDL: tl.constexpr,
):
    """y[n] = sum_k x[k] * w[n, k] (+ bias[n]) for BLOCK_N outputs over this program's K
    slice: [BLOCK_N, BLOCK_K] weight tiles, each row BLOCK_K contiguous elements, multiplied
    by x's slice in float32 and summed along K once at the end.

    The first weight tile is loaded before the wait for the kernel before (PDL): no kernel
    of a step writes weights, so with PDL this program's stream of weights starts while the
    norm or attention that produces x is still running."""
    pid_n = tl.program_id(0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wn
    k_first = tl.program_id(1) * K_PER_PROGRAM
    w_first = _weight_tile(w_rows, col_ok, k_first, ks, K)
    start_dependent_kernel(PDL)
    acc = w_first.to(tl.float32) * _x_slice(x_ptr, stride_xk, k_first, ks, K)
    for k_start in range(k_first + BLOCK_K, k_first + K_PER_PROGRAM, BLOCK_K):
        w = _weight_tile(w_rows, col_ok, k_start, ks, K)
        acc += w.to(tl.float32) * _x_slice(x_ptr, stride_xk, k_start, ks, K)
    store_gemv_output(tl.sum(acc, axis=1), cols, col_ok, N, partial_ptr, counter_ptr, bias_ptr,
                      bias_ptr, y_ptr, 0, stride_yn, False, HAS_BIAS, SPLIT)


def choose_dense_gemv_tiles(out_features: int, in_features: int) -> GemvTiles:
    """Two output rows x 2048 inputs a step, four warps: many small programs that each stream
    whole rows (the fastest of the tiles swept on the H200 for every projection of the 15B,
    30B-A3B and 0.6B shapes, `benchmarks/decode_gemv.py --sweep-tiles`: 1.1-1.7x faster than
    16-row slabs split along K). K is split only where the rows are too few
    for the GPU (`split_for`)."""
    block_k = max(16, min(2048, triton.next_power_of_2(in_features)))
    split = split_for(triton.cdiv(out_features, 2), triton.cdiv(in_features, block_k))
    return GemvTiles(2, block_k, 4, split, num_stages=1)


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               tiles: GemvTiles | None = None) -> torch.Tensor:
    """y [out] = x [in] @ weight [out, in]^T (+ bias) for one activation row, in x's dtype;
    tiles: None picks them (`choose_dense_gemv_tiles`)."""
    out_features, in_features = weight.shape
    if x.dim() != 1 or x.shape[0] != in_features:
        raise ValueError(f"dense_gemv takes one row of {in_features} inputs, got "
                         f"{list(x.shape)}")
    if weight.stride(1) != 1:
        raise ValueError("dense_gemv needs the weight's rows contiguous")
    tiles = tiles or choose_dense_gemv_tiles(out_features, in_features)
    y, partials, counters, steps = gemv_outputs(x, out_features, in_features, tiles)
    grid, launch = gemv_launch(tiles, out_features, steps, x.device)
    _dense_gemv_kernel[grid](
        x, weight, bias if bias is not None else y, y, partials, counters,
        out_features, x.stride(0), weight.stride(0), y.stride(0),
        K=in_features, HAS_BIAS=bias is not None, **launch,
    )
    return y
