"""Engine MoE: the reference latent MoE with its expert loop replaced by the fused kernels.

Routing (softmax or sigmoid, top-k, renormalisation) is one kernel; the experts run through
`fused_experts`, which on CUDA groups tokens by expert without reading anything back to the
host, so a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from muse.kernels.moe import fused_experts
from muse.kernels.routing import route_topk
from muse.reference.layers import LatentMoE


class EngineMoE(LatentMoE):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        config = self.config
        weights, expert_ids = route_topk(self.gate(x), config.num_experts_per_tok,
                                         config.router_scoring, config.norm_topk_prob)
        latent = self.pooler(x) if self.pooler is not None else x
        experts = self.experts
        combined = fused_experts(latent, weights, expert_ids, experts.gate_up_proj,
                                 experts.down_proj, experts.norm_weight, experts.eps)
        out = self.unpooler(combined) if self.unpooler is not None else combined
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out
