"""The routed experts of a decode step in one persistent launch: GEMM 1 + SwiGLU, GEMM 2, the
per-expert norm and the combine.

A batch-1 decode step runs the experts as three kernels a layer (`moe_triton.fused_experts`
with one pair per block), and each boundary costs the GPU a drain and a ramp-up: GEMM 2 waits
for the last GEMM 1 tile of every pair, the combine for the last GEMM 2 tile. Here a grid of
at most `PROGRAMS_PER_SM` programs per SM (2 unless set) works through a list of items,
program p taking items p, p + P, p + 2P, ... in order:

1. (pair, tile of I): h[pair, tile] = silu(x . gate_e) * (x . up_e), then the pair's
   counter is incremented;
2. (pair, tile of L): once the pair's counter shows all its GEMM 1 tiles, y[pair, tile] =
   h[pair] . down_e (float32), then the token's counter is incremented;
3. (token): once the token's counter shows all its pairs' GEMM 2 tiles, out[token] =
   sum_j weight_j * rms_norm(y[pair_j]) * norm_e (float32), in x's dtype.

So a pair's GEMM 2 starts as soon as its own h is complete, while other pairs' GEMM 1 tiles
still stream. An item waits only for lower items, and a program waiting at a GEMM 2 item has
done all its GEMM 1 items, so the programs it waits for are at GEMM 1 items, which never
wait (likewise for the combine): no deadlock once every program is resident, which a grid of
a few programs per SM is while their registers fit the SM's together (with PDL the next
kernel is launched only after each of these programs has started). Only one launch may run
at a time (one counter buffer per device; the engine runs its kernels on one stream). Under Triton's interpreter, which runs programs one after another,
the grid is one program. The last program to leave sets every counter back to zero for the
next launch (and for graph replays).

Each pair is one row, so both GEMMs are one-row products with float32 sums (no `tl.dot`:
the decode path's 16-row tiles use one row of sixteen). Dense 16-bit or float32 weights only;
the rounding points are the twin's (`muse.kernels.moe.fused_experts_torch`): h in the
activation dtype, y and the combine in float32, the output rounded once.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from muse.kernels.pdl import pdl_options, start_dependent_kernel

# Off until timed on the H200 against the three launches it replaces (`MUSE_MOE_PERSISTENT=1`
# turns it on for the decode steps it can serve).
PERSISTENT_MOE_ON = os.environ.get("MUSE_MOE_PERSISTENT", "0") == "1"
# Programs launched per SM (all must be resident at once: the waits rely on it). One program
# of 4 warps keeps few loads in flight; its registers (144 a thread at the proxy widths, 255
# at L = 7168, from the sm_90 compile) leave room for two or three.
PROGRAMS_PER_SM = int(os.environ.get("MUSE_MOE_PERSISTENT_PROGRAMS_PER_SM", "2"))
# Pairs and tokens a launch may hold (the counters' room); decode steps are well within.
MAX_PAIRS = 64
BLOCK_N1, BLOCK_N2, BLOCK_K = 16, 32, 128


@triton.jit
def _wait_for(counter_ptr, target):
    """Spin until the counter reaches `target` (acquire: the writes counted are visible)."""
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire")


@triton.jit
def _gemm1_item(item, x_ptr, gate_up_ptr, ids_ptr, h_ptr, pair_done_ptr,
                stride_xt, stride_we, stride_wn, stride_hm, top_k,
                LATENT: tl.constexpr, INTER: tl.constexpr, TILES1: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pair = item // TILES1
    cols = (item % TILES1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < INTER
    ks = tl.arange(0, BLOCK_K)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // top_k) * stride_xt
    gate_rows = gate_up_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn
    up_rows = gate_rows + INTER * stride_wn
    acc_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k_start in range(0, LATENT, BLOCK_K):
        k_ok = k_start + ks < LATENT
        a = tl.load(x_row + k_start + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        mask = col_ok[:, None] & k_ok[None, :]
        acc_gate += tl.load(gate_rows + k_start + ks[None, :], mask=mask,
                            other=0.0).to(tl.float32) * a
        acc_up += tl.load(up_rows + k_start + ks[None, :], mask=mask,
                          other=0.0).to(tl.float32) * a
    gate = tl.sum(acc_gate, axis=1)
    up = tl.sum(acc_up, axis=1)
    tl.store(h_ptr + pair * stride_hm + cols,
             (gate * tl.sigmoid(gate) * up).to(h_ptr.dtype.element_ty), mask=col_ok)
    # Every thread's part of the tile stored, then released with the count announcing it.
    tl.debug_barrier()
    tl.atomic_add(pair_done_ptr + pair, 1, sem="release")


@triton.jit
def _gemm2_item(item, h_ptr, down_ptr, ids_ptr, y_ptr, pair_done_ptr, token_done_ptr,
                stride_hm, stride_we, stride_wn, stride_ym, top_k,
                LATENT: tl.constexpr, INTER: tl.constexpr, TILES1: tl.constexpr,
                TILES2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pair = item // TILES2
    cols = (item % TILES2) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < LATENT
    ks = tl.arange(0, BLOCK_K)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    rows = down_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn
    _wait_for(pair_done_ptr + pair, TILES1)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k_start in range(0, INTER, BLOCK_K):
        k_ok = k_start + ks < INTER
        # .cg: h was written by other programs; read it from L2, not a stale L1 line.
        a = tl.load(h_ptr + pair * stride_hm + k_start + ks, mask=k_ok, other=0.0,
                    cache_modifier=".cg").to(tl.float32)[None, :]
        acc += tl.load(rows + k_start + ks[None, :], mask=col_ok[:, None] & k_ok[None, :],
                       other=0.0).to(tl.float32) * a
    tl.store(y_ptr + pair * stride_ym + cols, tl.sum(acc, axis=1), mask=col_ok)
    tl.debug_barrier()
    tl.atomic_add(token_done_ptr + pair // top_k, 1, sem="release")


@triton.jit
def _combine_item(token, y_ptr, weights_ptr, ids_ptr, norm_ptr, out_ptr, token_done_ptr,
                  eps, stride_ym, stride_ne, stride_ot,
                  LATENT: tl.constexpr, TOP_K: tl.constexpr, TILES2: tl.constexpr,
                  BLOCK_L: tl.constexpr, HAS_NORM: tl.constexpr):
    cols = tl.arange(0, BLOCK_L)
    col_ok = cols < LATENT
    _wait_for(token_done_ptr + token, TOP_K * TILES2)
    acc = tl.zeros((BLOCK_L,), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        pair = token * TOP_K + slot
        row = tl.load(y_ptr + pair * stride_ym + cols, mask=col_ok, other=0.0,
                      cache_modifier=".cg")
        if HAS_NORM:
            expert = tl.load(ids_ptr + pair).to(tl.int64)
            mean_square = tl.sum(row * row, axis=0) / LATENT
            norm = tl.load(norm_ptr + expert * stride_ne + cols, mask=col_ok, other=0.0)
            row = row * tl.rsqrt(mean_square + eps) * norm.to(tl.float32)
        acc += tl.load(weights_ptr + pair) * row
    tl.store(out_ptr + token * stride_ot + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _persistent_experts_kernel(
    x_ptr, weights_ptr, ids_ptr, gate_up_ptr, down_ptr, norm_ptr, h_ptr, y_ptr, out_ptr,
    counters_ptr, num_tokens, eps,
    stride_xt, stride_ge, stride_gn, stride_de, stride_dn, stride_ne, stride_hm, stride_ym,
    stride_ot,
    LATENT: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, HAS_NORM: tl.constexpr,
    TILES1: tl.constexpr, TILES2: tl.constexpr,
    BLOCK_N1: tl.constexpr, BLOCK_N2: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_L: tl.constexpr, MAX_PAIRS: tl.constexpr, PDL: tl.constexpr,
):
    """counters: [programs left, MAX_PAIRS pairs' GEMM 1 tiles done, MAX_PAIRS tokens'
    GEMM 2 tiles done], all zero between launches. TILES1 / TILES2: the BLOCK_N1 tiles of I
    and BLOCK_N2 tiles of L."""
    start_dependent_kernel(PDL)
    pair_done_ptr = counters_ptr + 1
    token_done_ptr = pair_done_ptr + MAX_PAIRS
    num_pairs = num_tokens * TOP_K
    first2 = num_pairs * TILES1
    first3 = first2 + num_pairs * TILES2
    total = first3 + num_tokens
    for item in range(tl.program_id(0), total, tl.num_programs(0)):
        if item < first2:
            _gemm1_item(item, x_ptr, gate_up_ptr, ids_ptr, h_ptr, pair_done_ptr,
                        stride_xt, stride_ge, stride_gn, stride_hm, TOP_K,
                        LATENT, INTER, TILES1, BLOCK_N1, BLOCK_K)
        elif item < first3:
            _gemm2_item(item - first2, h_ptr, down_ptr, ids_ptr, y_ptr, pair_done_ptr,
                        token_done_ptr, stride_hm, stride_de, stride_dn, stride_ym, TOP_K,
                        LATENT, INTER, TILES1, TILES2, BLOCK_N2, BLOCK_K)
        else:
            _combine_item(item - first3, y_ptr, weights_ptr, ids_ptr, norm_ptr, out_ptr,
                          token_done_ptr, eps, stride_ym, stride_ne, stride_ot,
                          LATENT, TOP_K, TILES2, BLOCK_L, HAS_NORM)
    # The last program to leave resets the counters (no program reads them after leaving).
    left = tl.atomic_add(counters_ptr, 1, sem="acq_rel")
    if left == tl.num_programs(0) - 1:
        offs = tl.arange(0, MAX_PAIRS)
        tl.store(pair_done_ptr + offs, tl.zeros((MAX_PAIRS,), dtype=tl.int32))
        tl.store(token_done_ptr + offs, tl.zeros((MAX_PAIRS,), dtype=tl.int32))
        tl.atomic_xchg(counters_ptr, 0)


# Counters per device, zero between launches; one buffer serves every launch on a stream in
# turn and is kept for CUDA graphs captured with it.
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device) -> torch.Tensor:
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(1 + 2 * MAX_PAIRS, dtype=torch.int32, device=device)
    return _COUNTERS[device]


def _programs(device: torch.device, items: int) -> int:
    """`PROGRAMS_PER_SM` programs per SM at most, each looping over its items; under the
    interpreter, which runs programs one after another (also with CUDA tensors), one: a
    second would wait for the first's later items."""
    if device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return min(items, sms * PROGRAMS_PER_SM)
    return 1


def takes_persistent_experts(x: torch.Tensor, gate_up: object, down: object,
                             num_pairs: int, reduce_pairs: object) -> bool:
    """Whether `persistent_experts` serves this call (with `MUSE_MOE_PERSISTENT=1`): dense
    weights in x's dtype, few pairs, no partial sums to reduce between GEMM 2 and the norm."""
    return (PERSISTENT_MOE_ON and reduce_pairs is None and 0 < num_pairs <= MAX_PAIRS
            and isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
            and gate_up.dtype == down.dtype == x.dtype
            and gate_up.stride(-1) == 1 and down.stride(-1) == 1 and x.stride(-1) == 1)


def persistent_experts(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
                       gate_up: torch.Tensor, down: torch.Tensor,
                       norm_weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`fused_experts`' result for x [T, L], weights [T, k] float32, expert_ids [T, k],
    gate_up [E, 2I, L], down [E, L, I] dense, in one launch (T * k <= MAX_PAIRS)."""
    num_tokens, latent = x.shape
    top_k = expert_ids.shape[1]
    inter = down.shape[2]
    num_pairs = num_tokens * top_k
    if not 0 < num_pairs <= MAX_PAIRS:
        raise ValueError(f"persistent_experts takes 1 to {MAX_PAIRS} pairs, got {num_pairs}")
    ids = expert_ids.contiguous()
    weights = weights.float().contiguous()
    out = torch.empty_like(x)
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(num_pairs, latent, dtype=torch.float32, device=x.device)
    tiles1, tiles2 = triton.cdiv(inter, BLOCK_N1), triton.cdiv(latent, BLOCK_N2)
    items = num_pairs * (tiles1 + tiles2) + num_tokens
    # The kernel reads the norm's rows with unit stride (a copy only when they have another).
    norm = norm_weight.contiguous() if norm_weight is not None else y
    _persistent_experts_kernel[(_programs(x.device, items),)](
        x, weights, ids, gate_up, down, norm, h, y, out, _counters(x.device), num_tokens, eps,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), down.stride(0), down.stride(1),
        norm.stride(0), h.stride(0), y.stride(0), out.stride(0),
        LATENT=latent, INTER=inter, TOP_K=top_k, HAS_NORM=norm_weight is not None,
        TILES1=tiles1, TILES2=tiles2, BLOCK_N1=BLOCK_N1, BLOCK_N2=BLOCK_N2, BLOCK_K=BLOCK_K,
        BLOCK_L=triton.next_power_of_2(latent), MAX_PAIRS=MAX_PAIRS, num_warps=4,
        **pdl_options(x.device))
    return out
