"""The router's GEMV and the top-k routing of one token in a single launch (batch-1 decode).

At batch 1 the MoE router is a one-row GEMV over a narrow matrix (128-256 experts) followed by
a one-program routing kernel: two launches, the second waiting for the first to finish, for a
few hundred logits. Here each program of the GEMV (`gemv_triton`'s tiles: two weight rows, up
to 2048 inputs a step, the first weight tile read before the PDL wait) stores its logits,
rounded to the activation dtype as the GEMV's output is, and counts itself in; the last program
to arrive reads the whole row back and routes it with `routing_triton.route_row`. The weights
and ids are bit for bit those of `dense_gemv` with the same tiles (K walked by one program,
never split) followed by `route_topk_triton`; the twin is
`route_topk_torch(F.linear(x, weight))`.

`MUSE_FUSED_ROUTER=1` makes the engine's MoE layers take it where the router is a plain weight
(`dense_linear.takes_fused_router`); off until timed on the H200.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muse.kernels.gemv_triton import row_sums, split_counters
from muse.kernels.pdl import pdl_options
from muse.kernels.routing_checks import check_arguments
from muse.kernels.routing_triton import route_row


@triton.jit
def _router_gemv_kernel(x_ptr, w_ptr, logits_ptr, counter_ptr, weights_ptr, ids_ptr,
                        num_experts, stride_xk, stride_wn,
                        K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOP: tl.constexpr,
                        SOFTMAX: tl.constexpr, NORMALIZE: tl.constexpr, PDL: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < num_experts
    sums = row_sums(x_ptr, stride_xk, w_ptr + cols[:, None].to(tl.int64) * stride_wn, col_ok,
                    0, tl.cdiv(K, BLOCK_K) * BLOCK_K, K, BLOCK_K, PDL)
    tl.store(logits_ptr + cols, sums.to(logits_ptr.dtype.element_ty), mask=col_ok)
    # acq_rel: this program's logits are visible before its arrival; the last to arrive sees
    # every program's logits.
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) - 1:
        experts = tl.arange(0, BLOCK_E)
        logits = tl.load(logits_ptr + experts, mask=experts < num_experts,
                         other=float("-inf"), cache_modifier=".cg").to(tl.float32)
        route_row(logits, weights_ptr, ids_ptr, num_experts, TOP_K, BLOCK_E, BLOCK_TOP,
                  SOFTMAX, NORMALIZE)
        tl.atomic_xchg(counter_ptr, 0)  # ready for the next call


def gate_route_topk_triton(x: torch.Tensor, weight: torch.Tensor, top_k: int, scoring: str,
                           normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [1, k] float32, ids [1, k] int64) of `route_topk(x @ weight^T, ...)` for one
    activation row x [1, hidden] and the router's weight [experts, hidden]."""
    num_experts, hidden = weight.shape
    if x.numel() != hidden or weight.stride(1) != 1:
        raise ValueError(f"the fused router takes one row of {hidden} inputs and a weight with "
                         f"contiguous rows, got x {list(x.shape)}")
    logits = torch.empty(num_experts, dtype=x.dtype, device=x.device)
    check_arguments(logits[None], top_k, scoring)
    weights = torch.empty(1, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(1, top_k, dtype=torch.int64, device=x.device)
    block_k = max(16, min(2048, triton.next_power_of_2(hidden)))
    row = x.reshape(-1)
    _router_gemv_kernel[(triton.cdiv(num_experts, 2),)](
        row, weight, logits, split_counters(x.device, 1), weights, ids,
        num_experts, row.stride(0), weight.stride(0),
        K=hidden, BLOCK_N=2, BLOCK_K=block_k, TOP_K=top_k,
        BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_TOP=triton.next_power_of_2(top_k),
        SOFTMAX=scoring == "softmax", NORMALIZE=normalize,
        num_warps=4, num_stages=1, **pdl_options(x.device))
    return weights, ids
