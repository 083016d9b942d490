"""MoE routing (scores, top-k, optional renormalisation): the dispatcher and its torch twin.

`route_topk_torch` is `muse.reference.layers.route` with explicit arguments instead of a
config: softmax or sigmoid of the float32 logits, `torch.topk`, and, with `normalize`, division
by the sum of the k chosen weights. That is four or five kernels on a GPU;
`muse.kernels.routing_triton` does the same in one launch.

Ties: among equal scores the kernel takes the lowest expert id first, i.e. the order of a
stable descending sort. torch.topk leaves the order of equal values unspecified (on the CPU it
often is not lowest-index-first), so where scores tie exactly the two paths may return different
ids -- always with the same weights. Ties need exactly equal float32 scores: equal logits (common
with bfloat16 logits and hundreds of experts) or a sigmoid saturated at 1.0.

NaN logits are not supported: torch.topk ranks NaN highest, the kernel's ids are unspecified.

`route_topk` dispatches: the kernel for CUDA tensors, the twin otherwise. Both have static
output shapes and never synchronise with the host, so they can be captured in a CUDA graph.
The kernel's exp and its reduction order differ from torch's, so the weights agree to a few
float32 ulps rather than bit for bit.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from muse.reference.layers import route

SCORINGS = ("softmax", "sigmoid")


def check_arguments(router_logits: torch.Tensor, top_k: int, scoring: str) -> None:
    """Raise ValueError unless the arguments suit both `route_topk` paths."""
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
    check_arguments(router_logits, top_k, scoring)
    # `route` reads only these three fields of its config.
    config = SimpleNamespace(router_scoring=scoring, num_experts_per_tok=top_k,
                             norm_topk_prob=normalize)
    return route(router_logits, config)


def route_topk(router_logits: torch.Tensor, top_k: int, scoring: str, normalize: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, ids [T, k] int64), best first.

    scoring: "softmax" or "sigmoid" (on the float32 logits); normalize: divide the k weights by
    their sum. The Triton kernel for CUDA tensors, `route_topk_torch` elsewhere.
    """
    if router_logits.is_cuda:
        # Imported here so that CPU-only processes never import Triton.
        from muse.kernels import routing_triton

        return routing_triton.route_topk_triton(router_logits, top_k, scoring, normalize)
    return route_topk_torch(router_logits, top_k, scoring, normalize)
