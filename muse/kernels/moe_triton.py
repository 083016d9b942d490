"""Triton kernels of the fused latent experts: grouped GEMMs over expert-sorted pairs, combine.

See `muse.kernels.moe` for the data flow. Every launch size below comes from tensor shapes and
python ints, and every kernel finds its work through device tensors (`block_expert`,
`sorted_pairs`, or `expert_ids` itself), so the whole call can be captured in a CUDA graph and
replayed with any routing.

Two ways to map pairs onto the GEMMs' M blocks, chosen from the shapes alone:

* aligned (many pairs): `align_pairs` sorts the pairs
  by expert into BLOCK_M-row blocks, so each expert's weights are streamed once per block of
  its pairs;
* one pair per block (decode: T*k <= min(64, E), or up to 64 pairs over experts that fit in
  L2; see `use_one_pair_per_block`): no alignment.
  Block b is pair b, its expert is expert_ids.flatten()[b], and only its row 0 is valid. The
  call is then exactly three launches (GEMM 1, GEMM 2, combine) plus the output allocations,
  instead of those three after the alignment.

Either GEMM's weight may be FP4 (`muse.kernels.w4a16.Fp4Weight`): the kernels' `FP4` switch
(a compile-time constant) replaces the dense weight loads by the packed-tile dequantization of
`muse.kernels.w4a16_triton`, the rest of the kernel (block rows, experts, masks) unchanged.
With one pair per block an FP4 GEMM runs as a GEMV (`GEMV`: the pair's row alone, without
`tl.dot`, `w4a16_triton.fp4_gemv_step`): the 15 padding rows cost nothing, and each block's
scale one multiply.
Or FP8 (`muse.kernels.w8a16.Fp8Weight`): the `FP8` switch keeps the dense loads, of the E4M3
bytes, and turns each loaded tile into the activation dtype with its rows' scales (`_fp8_tile`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from muse.kernels.moe import ExpertWeight
from muse.kernels.moe_align import PairReduce, align_pairs
from muse.kernels.pdl import pdl_options, start_dependent_kernel
from muse.kernels.w4a16 import Fp4Weight
from muse.kernels.w4a16_triton import even_odd_columns, fp4_gemv_step, fp4_weight_tiles
from muse.kernels.w8a16 import Fp8Weight


@dataclass(frozen=True)
class Tiles:
    block_m: int
    gemm1: tuple[int, int, int, int]  # BLOCK_N, BLOCK_K, num_warps, num_stages
    gemm2: tuple[int, int, int, int]


# The tiles of few pairs per expert; also those of the one-pair-per-block mode.
DECODE_TILES = Tiles(16, (32, 128, 4, 4), (32, 128, 4, 4))

# GEMM 2's widest prefill tile (256 columns) spills registers once each weight tile is also
# dequantized from FP4 (compiled for sm_90); FP4 down weights take at most 128. FP8 ones keep
# the dense tiles: their 256-column GEMM 2 compiles without spills.
FP4_MAX_GEMM2_BLOCK_N = 128

# Most (token, slot) pairs that skip the alignment (see use_one_pair_per_block).
ONE_PAIR_PER_BLOCK_MAX_PAIRS = 64
# Experts this small in all (every expert's weights, bytes) stay in the H200's 50 MB L2.
L2_RESIDENT_EXPERT_BYTES = 16 * 2**20


def use_one_pair_per_block(num_pairs: int, num_experts: int,
                           experts_bytes: int | None = None) -> bool:
    """Whether T*k pairs run one pair per M block, without `align_pairs` (shapes only).

    True for 0 < T*k <= min(64, E). Skipping the alignment saves about a dozen launches
    (~2-3 us each even inside a CUDA graph, ~30 us per layer). Its cost: pairs that share an
    expert read that expert's weights once per pair instead of once per block. P pairs over E
    experts hit about D = E * (1 - (1 - 1/E)^P) distinct experts, so the weight traffic grows
    by P / D: at most ~1.6x while P <= E (1.27x for 64 pairs over 128 experts: Qwen3-30B-A3B
    at batch 8), and the repeats come mostly from L2, as the programs of one N tile run side by
    side (grid axis 0, the pairs, varies fastest). Beyond E pairs, or past a few dozen, the
    repeats and the 15 idle rows of each 16-row block grow with the batch while the alignment's
    cost stays flat: there the aligned path wins.

    Also true for up to 64 pairs over more than E when all experts together (`experts_bytes`,
    every expert's gate_up and down as stored) fit in L2 with room to spare: the repeated reads
    then all come from L2 and cost a few microseconds, less than the alignment. That is a small
    model's speculative verify step (1 + k tokens a request, k pairs each, over few experts).
    """
    if not 0 < num_pairs <= ONE_PAIR_PER_BLOCK_MAX_PAIRS:
        return False
    return num_pairs <= num_experts or (experts_bytes is not None
                                        and experts_bytes <= L2_RESIDENT_EXPERT_BYTES)


def choose_tiles(num_pairs: int, num_experts: int) -> Tiles:
    """Tile sizes for H100/H200-class GPUs, from the mean number of pairs per expert.

    Few pairs per expert (decode): a block is mostly padding and the kernels are bound by
    streaming the expert weights, so the blocks are 16 rows (the smallest tl.dot accepts) and
    the output tiles narrow (32 columns) to spread each expert's weights over many programs.
    At batch 1 with k=8 there are 8 blocks; with I=768 GEMM 1 runs 8 x 24 programs and GEMM 2
    (N = L = 1024) 8 x 32, enough to keep every SM of the GPU loading weights; the long K tiles
    (128) with 4 stages keep several loads in flight per program.
    Many pairs per expert (prefill): the GEMMs become compute bound and larger tiles reuse each
    loaded weight tile across more rows. GEMM 1 keeps two accumulators (gate and up), so its
    N tile is a quarter of GEMM 2's. The largest tiles were measured on the H200 at 8192
    tokens (`benchmarks/tune_kernels.py`, docs/performance.md): GEMM 2 with 256 columns beat
    128 by 3-8% on both MoE shapes; wider GEMM 1 tiles did not help consistently.
    """
    per_expert = num_pairs / max(num_experts, 1)
    if per_expert <= 16:
        return DECODE_TILES
    if per_expert <= 96:
        return Tiles(64, (64, 64, 4, 3), (64, 64, 4, 3))
    return Tiles(128, (64, 64, 8, 3), (256, 64, 8, 3))


# Triton's interpreter multiplies bfloat16 tiles as raw uint16 words; under it the dot operands
# are widened to float32 first (exact for 16-bit floats, and the accumulation is float32 anyway).
_WIDEN_DOT = bool(triton.knobs.runtime.interpret)


def _fit(block: int, size: int) -> int:
    """Shrink a tile to the (power-of-two-rounded) size of a small dimension; tl.dot needs 16."""
    return max(16, min(block, triton.next_power_of_2(size)))


@triton.jit
def _block_rows(sorted_pairs_ptr, pid_m, num_pairs, BLOCK_M: tl.constexpr,
                ONE_PAIR_PER_BLOCK: tl.constexpr):
    """(h rows, pair ids, validity) of block pid_m's BLOCK_M rows."""
    offs = tl.arange(0, BLOCK_M)
    if ONE_PAIR_PER_BLOCK:
        # h has one row per pair, in pair order; rows 1.. of the block are padding (masked,
        # their out-of-range ids are never dereferenced).
        pairs = pid_m + offs
        valid = offs == 0
        rows = pairs
    else:
        rows = pid_m * BLOCK_M + offs
        pairs = tl.load(sorted_pairs_ptr + rows)
        valid = pairs < num_pairs
    return rows, pairs, valid


@triton.jit
def _fp8_tile(raw, scale, DTYPE: tl.constexpr):
    """A [K, N] tile of E4M3 bytes (N weight rows) times the rows' float32 scales (for this
    tile's inputs), rounded to DTYPE: one float32 product, then the activation dtype, as the
    twin rounds."""
    return (raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[None, :]).to(DTYPE)


@triton.jit
def _gemm1_swiglu_kernel(
    x_ptr, w_ptr, scales_ptr, row_factor_ptr, h_ptr, sorted_pairs_ptr, block_expert_ptr,
    num_pairs, top_k,
    stride_xt, stride_xl, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    stride_re, stride_rn, stride_hm, stride_hn,
    LATENT: tl.constexpr, INTER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, WIDEN: tl.constexpr, ONE_PAIR_PER_BLOCK: tl.constexpr,
    FP4: tl.constexpr, FP8: tl.constexpr, SCALE_BLOCK: tl.constexpr, SCALE_E8M0: tl.constexpr,
    HAS_ROW_FACTOR: tl.constexpr, GEMV: tl.constexpr, FP8_BLOCK_N: tl.constexpr,
    FP8_BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    """h[row, n] = silu(x[tok] . gate_e[n]) * (x[tok] . up_e[n]) for one block x N tile.

    The widths are compile-time constants: they are fixed per model, and known trip counts
    let the compiler drop the K masks when the widths are multiples of the tiles.
    ONE_PAIR_PER_BLOCK: block_expert_ptr is the flat [T*k] expert_ids, block b holds pair b
    alone (row 0; the other rows are masked) and sorted_pairs_ptr is not read.
    FP4: w_ptr is the packed experts [E, 2I, L/2] with their scales and (HAS_ROW_FACTOR) row
    factors (`fp4_weight_tiles`). FP8: w_ptr is the E4M3 bytes [E, 2I, L], read like a dense
    weight, and row_factor_ptr their row scales [E, 2I, 1] (HAS_ROW_FACTOR), or with
    FP8_BLOCK_N > 0 scales_ptr their block scales [E, 2I / FP8_BLOCK_N, L / FP8_BLOCK_K]
    (each K tile lies inside one block: its scales are a vector over the tile's columns).
    Otherwise w_ptr is the dense [E, 2I, L] and the scale and factor pointers are not read.
    GEMV (one pair per block, FP4 weights): the pair's row alone, without `tl.dot`
    (`fp4_gemv_step`).
    """
    start_dependent_kernel(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:  # past the last used block: nothing to do
        return
    rows, pairs, valid = _block_rows(sorted_pairs_ptr, pid_m, num_pairs, BLOCK_M,
                                     ONE_PAIR_PER_BLOCK)
    tokens = tl.where(valid, pairs // top_k, 0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < INTER
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    gate_factor = 1.0
    up_factor = 1.0
    if HAS_ROW_FACTOR:
        factor_ptrs = row_factor_ptr + expert * stride_re + cols * stride_rn
        gate_factor = tl.load(factor_ptrs, mask=col_ok, other=1.0).to(tl.float32)
        up_factor = tl.load(factor_ptrs + INTER * stride_rn, mask=col_ok,
                            other=1.0).to(tl.float32)

    if GEMV:
        w_ptr += expert * stride_we
        scales_ptr += expert * stride_se
        x_row = x_ptr + (pid_m // top_k) * stride_xt  # block pid_m is pair pid_m
        gemv_gate = tl.zeros((BLOCK_N, BLOCK_K // SCALE_BLOCK), dtype=tl.float32)
        gemv_up = tl.zeros((BLOCK_N, BLOCK_K // SCALE_BLOCK), dtype=tl.float32)
        for k_start in range(0, LATENT, BLOCK_K):
            gemv_gate += fp4_gemv_step(x_row, stride_xl, w_ptr, scales_ptr, cols, col_ok,
                                       k_start, stride_wn, stride_wk, stride_sn, stride_sk,
                                       LATENT, BLOCK_N, BLOCK_K, SCALE_BLOCK, SCALE_E8M0)
            gemv_up += fp4_gemv_step(x_row, stride_xl, w_ptr, scales_ptr, cols + INTER,
                                     col_ok, k_start, stride_wn, stride_wk, stride_sn,
                                     stride_sk, LATENT, BLOCK_N, BLOCK_K, SCALE_BLOCK,
                                     SCALE_E8M0)
        gate = tl.sum(gemv_gate, axis=1) * gate_factor
        up = tl.sum(gemv_up, axis=1) * up_factor
        tl.store(h_ptr + pid_m * stride_hm + cols * stride_hn,
                 (gate * tl.sigmoid(gate) * up).to(h_ptr.dtype.element_ty), mask=col_ok)
        return

    if FP4:
        w_ptr += expert * stride_we
        scales_ptr += expert * stride_se
        ks = tl.arange(0, BLOCK_K)
        for k_start in range(0, LATENT, BLOCK_K):
            # The even and odd inputs multiply the low and the high nibbles.
            a_even, a_odd = even_odd_columns(x_ptr, tokens, valid, k_start + ks, stride_xt,
                                             stride_xl, LATENT, BLOCK_M, BLOCK_K)
            gate_even, gate_odd = fp4_weight_tiles(
                w_ptr, scales_ptr, cols, col_ok, gate_factor, k_start,
                stride_wn, stride_wk, stride_sn, stride_sk,
                LATENT, BLOCK_N, BLOCK_K, SCALE_BLOCK, SCALE_E8M0, HAS_ROW_FACTOR)
            up_even, up_odd = fp4_weight_tiles(
                w_ptr, scales_ptr, cols + INTER, col_ok, up_factor, k_start,
                stride_wn, stride_wk, stride_sn, stride_sk,
                LATENT, BLOCK_N, BLOCK_K, SCALE_BLOCK, SCALE_E8M0, HAS_ROW_FACTOR)
            gate_even, gate_odd = gate_even.to(a_even.dtype), gate_odd.to(a_even.dtype)
            up_even, up_odd = up_even.to(a_even.dtype), up_odd.to(a_even.dtype)
            if WIDEN:
                a_even, a_odd = a_even.to(tl.float32), a_odd.to(tl.float32)
                gate_even, gate_odd = gate_even.to(tl.float32), gate_odd.to(tl.float32)
                up_even, up_odd = up_even.to(tl.float32), up_odd.to(tl.float32)
            acc_gate = tl.dot(a_even, gate_even, acc_gate, input_precision=PRECISION)
            acc_gate = tl.dot(a_odd, gate_odd, acc_gate, input_precision=PRECISION)
            acc_up = tl.dot(a_even, up_even, acc_up, input_precision=PRECISION)
            acc_up = tl.dot(a_odd, up_odd, acc_up, input_precision=PRECISION)
    else:
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + tokens[:, None] * stride_xt + ks[None, :] * stride_xl
        # Weight tiles are loaded as [K, N] views of the row-major [2I, L] expert matrix.
        gate_ptrs = (w_ptr + expert * stride_we + cols[None, :] * stride_wn
                     + ks[:, None] * stride_wk)
        up_ptrs = gate_ptrs + INTER * stride_wn
        for k_start in range(0, LATENT, BLOCK_K):
            k_ok = ks < LATENT - k_start
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & col_ok[None, :]
            gate = tl.load(gate_ptrs, mask=w_mask, other=0.0)
            up = tl.load(up_ptrs, mask=w_mask, other=0.0)
            if FP8:
                if FP8_BLOCK_N:  # this K tile's block scales (not carried: a new name)
                    block_ptrs = (scales_ptr + expert * stride_se
                                  + (k_start // FP8_BLOCK_K) * stride_sk)
                    gate_scale = tl.load(block_ptrs + (cols // FP8_BLOCK_N) * stride_sn,
                                         mask=col_ok, other=0.0)
                    up_scale = tl.load(block_ptrs + ((cols + INTER) // FP8_BLOCK_N)
                                       * stride_sn, mask=col_ok, other=0.0)
                else:
                    gate_scale, up_scale = gate_factor, up_factor
                gate = _fp8_tile(gate, gate_scale, a.dtype)
                up = _fp8_tile(up, up_scale, a.dtype)
            if WIDEN:
                a, gate, up = a.to(tl.float32), gate.to(tl.float32), up.to(tl.float32)
            acc_gate = tl.dot(a, gate, acc_gate, input_precision=PRECISION)
            acc_up = tl.dot(a, up, acc_up, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_xl
            gate_ptrs += BLOCK_K * stride_wk
            up_ptrs += BLOCK_K * stride_wk

    h = acc_gate * tl.sigmoid(acc_gate) * acc_up
    h_ptrs = h_ptr + rows[:, None] * stride_hm + cols[None, :] * stride_hn
    # Padding rows are not stored (GEMM 2 masks them out of its loads and stores).
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _gemm2_kernel(
    h_ptr, w_ptr, scales_ptr, row_factor_ptr, y_ptr, sorted_pairs_ptr, block_expert_ptr,
    num_pairs,
    stride_hm, stride_hk, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    stride_re, stride_rn, stride_ym, stride_yn,
    LATENT: tl.constexpr, INTER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, WIDEN: tl.constexpr, ONE_PAIR_PER_BLOCK: tl.constexpr,
    FP4: tl.constexpr, FP8: tl.constexpr, SCALE_BLOCK: tl.constexpr, SCALE_E8M0: tl.constexpr,
    HAS_ROW_FACTOR: tl.constexpr, GEMV: tl.constexpr, FP8_BLOCK_N: tl.constexpr,
    FP8_BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    """y[pair, n] = h[row] . down_e[n] for one block x N tile (N over the latent width).

    ONE_PAIR_PER_BLOCK, FP4 (down packed as [E, L, I/2]), FP8 (down [E, L, I] E4M3 bytes) and
    GEMV as in `_gemm1_swiglu_kernel`.
    """
    start_dependent_kernel(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    rows, pairs, valid = _block_rows(sorted_pairs_ptr, pid_m, num_pairs, BLOCK_M,
                                     ONE_PAIR_PER_BLOCK)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < LATENT
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    factor = 1.0
    if HAS_ROW_FACTOR:
        factor = tl.load(row_factor_ptr + expert * stride_re + cols * stride_rn,
                         mask=col_ok, other=1.0).to(tl.float32)

    if GEMV:  # h's row pid_m is pair pid_m's
        w_ptr += expert * stride_we
        scales_ptr += expert * stride_se
        gemv = tl.zeros((BLOCK_N, BLOCK_K // SCALE_BLOCK), dtype=tl.float32)
        for k_start in range(0, INTER, BLOCK_K):
            gemv += fp4_gemv_step(h_ptr + pid_m * stride_hm, stride_hk, w_ptr, scales_ptr,
                                  cols, col_ok, k_start, stride_wn, stride_wk, stride_sn,
                                  stride_sk, INTER, BLOCK_N, BLOCK_K, SCALE_BLOCK, SCALE_E8M0)
        tl.store(y_ptr + pid_m * stride_ym + cols * stride_yn,
                 tl.sum(gemv, axis=1) * factor, mask=col_ok)
        return

    # h rows are in block order (sorted, or pair order with one pair per block), so this
    # block's rows are contiguous: no gather here.
    if FP4:
        w_ptr += expert * stride_we
        scales_ptr += expert * stride_se
        ks = tl.arange(0, BLOCK_K)
        for k_start in range(0, INTER, BLOCK_K):
            a_even, a_odd = even_odd_columns(h_ptr, rows, valid, k_start + ks, stride_hm,
                                             stride_hk, INTER, BLOCK_M, BLOCK_K)
            b_even, b_odd = fp4_weight_tiles(
                w_ptr, scales_ptr, cols, col_ok, factor, k_start,
                stride_wn, stride_wk, stride_sn, stride_sk,
                INTER, BLOCK_N, BLOCK_K, SCALE_BLOCK, SCALE_E8M0, HAS_ROW_FACTOR)
            b_even, b_odd = b_even.to(a_even.dtype), b_odd.to(a_even.dtype)
            if WIDEN:
                a_even, a_odd = a_even.to(tl.float32), a_odd.to(tl.float32)
                b_even, b_odd = b_even.to(tl.float32), b_odd.to(tl.float32)
            acc = tl.dot(a_even, b_even, acc, input_precision=PRECISION)
            acc = tl.dot(a_odd, b_odd, acc, input_precision=PRECISION)
    else:
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = h_ptr + rows[:, None] * stride_hm + ks[None, :] * stride_hk
        b_ptrs = (w_ptr + expert * stride_we + cols[None, :] * stride_wn
                  + ks[:, None] * stride_wk)
        for k_start in range(0, INTER, BLOCK_K):
            k_ok = ks < INTER - k_start
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if FP8:
                if FP8_BLOCK_N:  # this K tile's block scales
                    b_scale = tl.load(scales_ptr + expert * stride_se
                                      + (cols // FP8_BLOCK_N) * stride_sn
                                      + (k_start // FP8_BLOCK_K) * stride_sk,
                                      mask=col_ok, other=0.0)
                else:
                    b_scale = factor
                b = _fp8_tile(b, b_scale, a.dtype)
            if WIDEN:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_hk
            b_ptrs += BLOCK_K * stride_wk

    # Scattered back to pair order so that the combine finds a token's k rows side by side.
    pairs = tl.where(valid, pairs, 0)
    y_ptrs = y_ptr + pairs[:, None] * stride_ym + cols[None, :] * stride_yn
    tl.store(y_ptrs, acc, mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _moe_combine_kernel(
    y_ptr, weights_ptr, ids_ptr, norm_ptr, out_ptr,
    latent, eps, stride_ym, stride_ne, stride_ot,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_L: tl.constexpr, HAS_NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[t] = sum_j weights[t, j] * rmsnorm(y[t*k + j]) * norm_weight[ids[t, j]].

    A token's k rows are one [BLOCK_K, BLOCK_L] tile: every load is issued at once and each
    reduction runs once over the tile, not once a slot (at batch 1 the whole combine is one
    program, so its chain of dependent steps is the layer's critical path)."""
    start_dependent_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, BLOCK_K)
    cols = tl.arange(0, BLOCK_L)
    slot_ok = slots < TOP_K
    col_ok = cols < latent
    tile_ok = slot_ok[:, None] & col_ok[None, :]
    pairs = token * TOP_K + slots
    rows = tl.load(y_ptr + pairs[:, None] * stride_ym + cols[None, :], mask=tile_ok, other=0.0)
    weights = tl.load(weights_ptr + pairs, mask=slot_ok, other=0.0)
    if HAS_NORM:
        experts = tl.load(ids_ptr + pairs, mask=slot_ok, other=0)
        norm = tl.load(norm_ptr + experts[:, None] * stride_ne + cols[None, :], mask=tile_ok,
                       other=0.0)
        mean_square = tl.sum(rows * rows, axis=1) / latent
        rows = rows * tl.rsqrt(mean_square + eps)[:, None] * norm.to(tl.float32)
    out = tl.sum(weights[:, None] * rows, axis=0)
    tl.store(out_ptr + token * stride_ot + cols, out.to(out_ptr.dtype.element_ty), mask=col_ok)


_DENSE_FORMAT = dict(FP4=False, FP8=False, SCALE_BLOCK=1, SCALE_E8M0=False,
                     HAS_ROW_FACTOR=False, FP8_BLOCK_N=0, FP8_BLOCK_K=0)


def _weight_args(weight: ExpertWeight) -> tuple[list, dict]:
    """A GEMM kernel's weight arguments: (weight, scales, row factors and their strides),
    and the format constexprs. The weight stands in for the pointers its format lacks."""
    if isinstance(weight, Fp8Weight):
        data, scale = weight.weight_bytes, weight.scale
        if weight.block is not None:  # block scales as the FP4 scales' pointer and strides
            block_n, block_k = weight.block
            return [data, scale, data, *data.stride(), *scale.stride(), 0, 0], \
                _DENSE_FORMAT | dict(FP8=True, FP8_BLOCK_N=block_n, FP8_BLOCK_K=block_k)
        return [data, data, scale, *data.stride(), 0, 0, 0, scale.stride(0),
                scale.stride(1)], _DENSE_FORMAT | dict(FP8=True, HAS_ROW_FACTOR=True)
    if not isinstance(weight, Fp4Weight):
        return [weight, weight, weight, *weight.stride(), 0, 0, 0, 0, 0], _DENSE_FORMAT
    packed, scales, factor = weight.packed, weight.scale_bytes, weight.row_factor
    has_factor = factor is not None
    factor_strides = [factor.stride(0), factor.stride(1)] if has_factor else [0, 0]
    return [packed, scales, factor if has_factor else packed, *packed.stride(),
            *scales.stride(), *factor_strides], _DENSE_FORMAT | dict(
        FP4=True, SCALE_BLOCK=weight.block, SCALE_E8M0=weight.scale_is_e8m0,
        HAS_ROW_FACTOR=has_factor)


def _fit_k(block_k: int, size: int, weight: ExpertWeight) -> int:
    """`_fit` for a K tile; an FP4 weight's is split into even and odd halves of >= 16 and
    covers whole scale blocks; a block-scaled FP8 weight's stays inside one scale block."""
    if isinstance(weight, Fp4Weight):
        return max(32, weight.block, _fit(block_k, size))
    if isinstance(weight, Fp8Weight) and weight.block is not None:
        scale_k = weight.block[1]
        if scale_k & (scale_k - 1) or scale_k < 16:
            raise ValueError(f"FP8 block scales need a power-of-two block of >= 16 inputs, "
                             f"got {scale_k}")
        return min(scale_k, _fit(block_k, size))
    return _fit(block_k, size)


def _check_experts(gate_up: ExpertWeight, down: ExpertWeight, latent: int) -> None:
    num_experts, inter = gate_up.shape[0], down.shape[2]
    if (tuple(gate_up.shape) != (num_experts, 2 * inter, latent)
            or tuple(down.shape) != (num_experts, latent, inter)):
        raise ValueError(f"expert weights must be gate_up [E, 2I, L] and down [E, L, I] with "
                         f"L = {latent}, got {list(gate_up.shape)} and {list(down.shape)}")


def _stored_bytes(weight: ExpertWeight) -> int:
    """Bytes of an expert weight as the kernels read it."""
    if isinstance(weight, Fp4Weight):
        return weight.packed.nbytes + weight.scale_bytes.nbytes
    if isinstance(weight, Fp8Weight):
        return weight.weight_bytes.nbytes + weight.scale.nbytes
    return weight.nbytes


def fused_experts(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
                  gate_up: ExpertWeight, down: ExpertWeight,
                  norm_weight: torch.Tensor | None,
                  eps: float, one_pair_per_block: bool | None = None,
                  tiles: Tiles | None = None,
                  reduce_pairs: PairReduce | None = None) -> torch.Tensor:
    """The Triton path of `muse.kernels.moe.fused_experts` (same arguments and result).

    gate_up / down: dense [E, 2I, L] / [E, L, I] in the activation dtype, or `Fp4Weight`s
    (NVFP4, MXFP4) or `Fp8Weight`s of those shapes (each GEMM reads its weight's format as
    stored).
    one_pair_per_block: None picks the mode from the number of pairs
    (`use_one_pair_per_block`); True / False force it (tests, benchmarks). tiles: None
    picks them from the shapes (`choose_tiles`); given, they are used (tuning).
    """
    num_tokens, latent = x.shape
    top_k = expert_ids.shape[1]
    num_experts, inter = gate_up.shape[0], down.shape[2]
    _check_experts(gate_up, down, latent)
    num_pairs = num_tokens * top_k
    out = torch.empty(num_tokens, latent, dtype=x.dtype, device=x.device)
    if num_pairs == 0:
        return out
    if one_pair_per_block is None:
        one_pair_per_block = use_one_pair_per_block(
            num_pairs, num_experts, _stored_bytes(gate_up) + _stored_bytes(down))

    # The kernels index expert_ids and weights as flat [T*k] arrays. route's outputs already
    # are contiguous, weights float32: then nothing is copied (no torch op runs at all).
    if not expert_ids.is_contiguous():
        expert_ids = expert_ids.contiguous()
    if weights.dtype != torch.float32 or not weights.is_contiguous():
        weights = weights.float().contiguous()

    if one_pair_per_block:
        # Block b is pair b; the kernels read its expert straight from expert_ids and never
        # read sorted_pairs (any pointer will do). Pairs that share an expert each stream
        # its weights, mostly from L2 (see use_one_pair_per_block): fine at decode sizes.
        tiles = tiles or DECODE_TILES
        sorted_pairs, block_expert = expert_ids, expert_ids
        num_blocks = num_rows = num_pairs
    else:
        tiles = tiles or choose_tiles(num_pairs, num_experts)
        sorted_pairs, block_expert = align_pairs(expert_ids, num_experts, tiles.block_m)
        num_blocks, num_rows = block_expert.numel(), sorted_pairs.numel()
    # Float32 models are the precise reference configuration: keep TF32 out of their dots.
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    pdl = pdl_options(x.device)

    # h has a row per block row (aligned: padding rows are allocated, never written; one pair
    # per block: one row per pair), so GEMM 2 reads it without a gather; it is in the
    # activation dtype, as the reference rounds it there.
    # Grid axis 0 (blocks) varies fastest: programs that run together work on neighbouring
    # blocks, mostly of one expert, and share the same weight tile through L2.
    h = torch.empty(num_rows, inter, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = tiles.gemm1
    block_n, block_k = _fit(block_n, inter), _fit_k(block_k, latent, gate_up)
    (w, scales, factor, *w_strides), w_format = _weight_args(gate_up)
    _gemm1_swiglu_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x, w, scales, factor, h, sorted_pairs, block_expert,
        num_pairs, top_k,
        x.stride(0), x.stride(1), *w_strides,
        h.stride(0), h.stride(1), LATENT=latent, INTER=inter,
        BLOCK_M=tiles.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION=precision, WIDEN=_WIDEN_DOT, ONE_PAIR_PER_BLOCK=one_pair_per_block,
        GEMV=one_pair_per_block and w_format["FP4"], **w_format, num_warps=warps,
        num_stages=stages, **pdl,
    )

    # y stays float32: it feeds an RMSNorm and a k-way weighted sum, and rounding it to bf16
    # would add a third rounding of every output on top of h's and out's. It costs
    # T*k*L*8 bytes of write+read: nothing next to the expert weights when decoding, and
    # small next to the compute-bound GEMMs when prefilling.
    y = torch.empty(num_pairs, latent, dtype=torch.float32, device=x.device)
    block_n, block_k, warps, stages = tiles.gemm2
    if isinstance(down, Fp4Weight):
        block_n = min(block_n, FP4_MAX_GEMM2_BLOCK_N)
    block_n, block_k = _fit(block_n, latent), _fit_k(block_k, inter, down)
    (w, scales, factor, *w_strides), w_format = _weight_args(down)
    _gemm2_kernel[(num_blocks, triton.cdiv(latent, block_n))](
        h, w, scales, factor, y, sorted_pairs, block_expert,
        num_pairs,
        h.stride(0), h.stride(1), *w_strides,
        y.stride(0), y.stride(1), LATENT=latent, INTER=inter,
        BLOCK_M=tiles.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION=precision, WIDEN=_WIDEN_DOT, ONE_PAIR_PER_BLOCK=one_pair_per_block,
        GEMV=one_pair_per_block and w_format["FP4"], **w_format, num_warps=warps,
        num_stages=stages, **pdl,
    )

    if reduce_pairs is not None:
        # Every y row is written above (each real pair once, in both modes), so a reduction
        # over ranks sees no uninitialised rows. The combine reads rows with unit column
        # stride; a contiguous result (the usual case) is not copied.
        y = reduce_pairs(y).contiguous()

    has_norm = norm_weight is not None
    norm = y  # any pointer; never read without norm
    if has_norm:
        norm = norm_weight if norm_weight.stride(1) == 1 else norm_weight.contiguous()
    block_l = triton.next_power_of_2(latent)
    block_k = triton.next_power_of_2(top_k)
    # A warp per 1,024 elements of the tile (top-8 of 1024: 8 warps, 32 floats a thread), 4-16.
    _moe_combine_kernel[(num_tokens,)](
        y, weights, expert_ids, norm, out,
        latent, eps, y.stride(0), norm.stride(0), out.stride(0),
        TOP_K=top_k, BLOCK_K=block_k, BLOCK_L=block_l, HAS_NORM=has_norm,
        num_warps=min(16, max(4, block_k * block_l // 1024)), **pdl,
    )
    return out
