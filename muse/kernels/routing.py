"""MoE routing (scores, top-k, optional renormalisation): the torch twin of the Triton kernel.

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

The "triton" MoE backend routes with the kernel, "torch" with the twin (`muse.kernels.backends`).
Both have static
output shapes and never synchronise with the host, so they can be captured in a CUDA graph.
The kernel's exp and its reduction order differ from torch's, so the weights agree to a few
float32 ulps rather than bit for bit.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from muse.kernels.routing_checks import check_arguments
from muse.reference.layers import route

def route_topk_torch(router_logits: torch.Tensor, top_k: int, scoring: str, normalize: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, ids [T, k] int64): the reference ops."""
    check_arguments(router_logits, top_k, scoring)
    # `route` reads only these three fields of its config.
    config = SimpleNamespace(router_scoring=scoring, num_experts_per_tok=top_k,
                             norm_topk_prob=normalize)
    return route(router_logits, config)
