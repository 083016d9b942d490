"""MoE routing (scores, top-k, optional renormalisation) as one Triton kernel with a torch twin.

`route_topk_torch` is `muse.reference.layers.route` spelled with explicit arguments: softmax or
sigmoid of the float32 logits, `torch.topk`, and, with `normalize`, division by the sum of the k
chosen weights. It takes four or five kernels on a GPU; `route_topk_triton` does the same in one
launch, one program per token:

* the whole row of E logits is loaded at once (one power-of-two block, E up to a few thousand;
  MoE models use at most a few hundred experts) and widened to float32;
* softmax as torch computes it, exp(x - max) / sum, or sigmoid;
* k rounds of "take the maximum, then mask it out", so the k ids come out sorted by descending
  score, as torch.topk's do (sorted=True);
* with `normalize`, the k weights are divided by their sum.

Ties: among equal scores the kernel takes the lowest expert id first, i.e. the order of a
stable descending sort. torch.topk leaves the order of equal values unspecified (on the CPU it
often is not lowest-index-first), so where scores tie exactly the two paths may return different
ids -- always with the same weights. Ties need exactly equal float32 scores: equal logits (common
with bfloat16 logits and hundreds of experts) or a sigmoid saturated at 1.0.

NaN logits are not supported: torch.topk ranks NaN highest, the kernel's ids are unspecified.

`route_topk` dispatches: the kernel for CUDA tensors when Triton is installed, the twin
otherwise. Both have static output shapes and never synchronise with the host, so they can be
captured in a CUDA graph. The kernel's exp and its reduction order differ from torch's, so the
weights agree to a few float32 ulps rather than bit for bit.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

# Triton is optional (the twin covers every device) and imported at the first launch, not with
# this module: its import fixes whether kernels are compiled or interpreted (TRITON_INTERPRET),
# and CPU-only processes need not pay for it.
HAS_TRITON = importlib.util.find_spec("triton") is not None
triton: Any = None
tl: Any = None

SCORINGS = ("softmax", "sigmoid")


def _check(router_logits: torch.Tensor, top_k: int, scoring: str) -> None:
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    if router_logits.dim() != 2:
        raise ValueError("router_logits must be [tokens, experts], got "
                         f"{tuple(router_logits.shape)}")
    if not 1 <= top_k <= router_logits.shape[1]:
        raise ValueError(f"top_k must be in [1, {router_logits.shape[1]}], got {top_k}")


def route_topk_torch(router_logits: torch.Tensor, top_k: int, scoring: str, normalize: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, ids [T, k] int64): the reference ops."""
    _check(router_logits, top_k, scoring)
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if scoring == "softmax" else logits.sigmoid()
    weights, ids = scores.topk(top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@functools.cache
def _jit(fn: Callable) -> Callable:
    """`fn` as a Triton kernel, importing Triton into this module's globals on first use."""
    global triton, tl
    import triton
    import triton.language as tl
    return triton.jit(fn)


# A Triton kernel, decorated by `_jit` at its first launch.
def _route_topk_kernel(logits_ptr, weights_ptr, ids_ptr,
                       num_experts, stride_lt, stride_le, stride_wt, stride_it,
                       TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                       SOFTMAX: tl.constexpr, NORMALIZE: tl.constexpr):
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
        top_weights = tl.where(slots == slot, best, top_weights)
        top_ids = tl.where(slots == slot, best_id.to(tl.int64), top_ids)
        scores = tl.where(experts == best_id, -1.0, scores)
    if NORMALIZE:
        top_weights = top_weights / tl.sum(tl.where(slots < TOP_K, top_weights, 0.0), axis=0)
    in_k = slots < TOP_K
    tl.store(weights_ptr + token * stride_wt + slots, top_weights, mask=in_k)
    tl.store(ids_ptr + token * stride_it + slots, top_ids, mask=in_k)


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def route_topk_triton(router_logits: torch.Tensor, top_k: int, scoring: str, normalize: bool
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-launch Triton path of `route_topk` (same arguments and results)."""
    if not HAS_TRITON:
        raise RuntimeError("the Triton routing kernel needs the `triton` package")
    _check(router_logits, top_k, scoring)
    kernel = _jit(_route_topk_kernel)
    num_tokens, num_experts = router_logits.shape
    device = router_logits.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=device)
    if num_tokens == 0:
        return weights, ids
    block_e = _next_power_of_2(num_experts)
    # Every round of the top-k loop is two reductions over the row: few warps keep them cheap
    # (one warp holds 16 scores a thread at E = 512).
    kernel[(num_tokens,)](
        router_logits, weights, ids,
        num_experts, router_logits.stride(0), router_logits.stride(1),
        weights.stride(0), ids.stride(0),
        TOP_K=top_k, BLOCK_E=block_e, BLOCK_K=_next_power_of_2(top_k),
        SOFTMAX=scoring == "softmax", NORMALIZE=normalize,
        num_warps=max(1, min(8, block_e // 512)),
    )
    return weights, ids


def route_topk(router_logits: torch.Tensor, top_k: int, scoring: str, normalize: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, ids [T, k] int64), best first.

    scoring: "softmax" or "sigmoid" (on the float32 logits); normalize: divide the k weights by
    their sum. The Triton kernel for CUDA tensors, `route_topk_torch` elsewhere.
    """
    if HAS_TRITON and router_logits.is_cuda:
        return route_topk_triton(router_logits, top_k, scoring, normalize)
    return route_topk_torch(router_logits, top_k, scoring, normalize)
