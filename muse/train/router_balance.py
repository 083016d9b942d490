"""The load-balancing loss that keeps MoE routing from collapsing onto a few experts.

The reference model computes routing but no auxiliary loss, so training collects each
layer's router logits with forward hooks and adds the Switch Transformer loss
`E * sum_e(fraction of top-k slots given to e * mean router probability of e)`, which is 1
when the load is even and grows as it concentrates.
"""

from __future__ import annotations

import torch
from torch import nn

from muse.reference.layers import LatentMoE


class RouterLoadBalance:
    """Hooks on every `LatentMoE` router; `loss()` reads what the last forward routed."""

    def __init__(self, model: nn.Module, top_k: int) -> None:
        self.top_k = top_k
        self.logits: list[torch.Tensor] = []
        self.handles = [module.gate.register_forward_hook(self._record)
                        for module in model.modules() if isinstance(module, LatentMoE)]

    def _record(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        self.logits.append(output)

    def loss(self) -> torch.Tensor | None:
        """The mean balance loss over layers since the last call, or None without MoE layers."""
        if not self.logits:
            return None
        total = []
        for logits in self.logits:
            probs = logits.float().softmax(dim=-1)
            experts = probs.shape[-1]
            chosen = probs.topk(self.top_k, dim=-1).indices.reshape(-1)
            load = torch.bincount(chosen, minlength=experts).float() / chosen.numel()
            total.append(experts * (load * probs.mean(dim=0)).sum())
        self.logits = []
        return torch.stack(total).mean()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
