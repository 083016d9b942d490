"""MoE routing as one Triton kernel, one program per token.

Same contract as `muse.kernels.routing.route_topk_torch` (see that module for ties and NaNs):

* the whole row of E logits is loaded at once (one power-of-two block, E up to a few thousand;
  MoE models use at most a few hundred experts) and widened to float32;
* softmax as torch computes it, exp(x - max) / sum, or sigmoid;
* k rounds of "take the maximum, then mask it out", so the k ids come out sorted by descending
  score, as torch.topk's do (sorted=True);
* with `normalize`, the k weights are divided by their sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muse.kernels.pdl import pdl_options, start_dependent_kernel
from muse.kernels.routing_checks import check_arguments


@triton.jit
def _route_topk_kernel(logits_ptr, weights_ptr, ids_ptr,
                       num_experts, stride_lt, stride_le, stride_wt, stride_it,
                       TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                       SOFTMAX: tl.constexpr, NORMALIZE: tl.constexpr, PDL: tl.constexpr):
    start_dependent_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    in_row = experts < num_experts
    logits = tl.load(logits_ptr + token * stride_lt + experts * stride_le, mask=in_row,
                     other=float("-inf")).to(tl.float32)
    if SOFTMAX:
        exps = tl.exp(logits - tl.max(logits, axis=0))  # 0 past the row's end
        scores = exps / tl.sum(exps, axis=0)
    else:
        scores = tl.sigmoid(logits)
    # Scores are >= 0; -1 marks lanes past the row's end and experts already taken.
    scores = tl.where(in_row, scores, -1.0)

    slots = tl.arange(0, BLOCK_K)
    top_weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
    top_ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for slot in tl.static_range(TOP_K):
        best = tl.max(scores, axis=0)
        # Lowest id among the maxima: the order of a stable descending sort.
        best_id = tl.min(tl.where(scores == best, experts, BLOCK_E), axis=0)
        # A row of NaN (a graph's padding row gone bad) matches no maximum: an id past the
        # experts would index out of bounds downstream, so it takes the last one instead.
        best_id = tl.minimum(best_id, num_experts - 1)
        top_weights = tl.where(slots == slot, best, top_weights)
        top_ids = tl.where(slots == slot, best_id.to(tl.int64), top_ids)
        scores = tl.where(experts == best_id, -1.0, scores)
    if NORMALIZE:
        top_weights = top_weights / tl.sum(tl.where(slots < TOP_K, top_weights, 0.0), axis=0)
    in_k = slots < TOP_K
    tl.store(weights_ptr + token * stride_wt + slots, top_weights, mask=in_k)
    tl.store(ids_ptr + token * stride_it + slots, top_ids, mask=in_k)


def route_topk_triton(router_logits: torch.Tensor, top_k: int, scoring: str, normalize: bool
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-launch Triton path of `route_topk` (same arguments and results)."""
    check_arguments(router_logits, top_k, scoring)
    num_tokens, num_experts = router_logits.shape
    device = router_logits.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=device)
    if num_tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(num_experts)
    # Every round of the top-k loop is two reductions over the row: few warps keep them cheap
    # (one warp holds 16 scores a thread at E = 512).
    _route_topk_kernel[(num_tokens,)](
        router_logits, weights, ids,
        num_experts, router_logits.stride(0), router_logits.stride(1),
        weights.stride(0), ids.stride(0),
        TOP_K=top_k, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
        SOFTMAX=scoring == "softmax", NORMALIZE=normalize, **pdl_options(device),
        num_warps=max(1, min(8, block_e // 512)),
    )
    return weights, ids
