"""Engine feed-forward blocks: the dense SwiGLU MLP and the latent MoE.

The latent MoE routes on the hidden state (every rank routes every token the same way), pools
to the latent width, runs the routed experts (`FusedMoE`: intermediate split over TP, or whole
experts split over EP) and unpools. The router, pooler and unpooler are small and replicated.
The products that read the block's input (router, pooler, a shared expert's gate and up) keep
their weights in one tensor when all are plain products, so a one-row step (batch-1 decode)
computes them in one launch.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from muse.config import TextConfig
from muse.kernels.backends import MoEBackend
from muse.kernels.dense_linear import dense_linear
from muse.layers.fused_moe import FusedMoE
from muse.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from muse.layers.quantization import QuantizationConfig


# `MUSE_STACKED_INPUTS=0`: the MoE's input products stay separate launches in one-row steps
# (to time the stacked product against them).
STACKED_INPUTS_ON = os.environ.get("MUSE_STACKED_INPUTS", "1") != "0"


class EngineMLP(nn.Module):
    """SwiGLU: gate and up in one column-parallel GEMM, down row-parallel (one all-reduce)."""

    def __init__(self, hidden: int, intermediate: int, params_dtype: torch.dtype,
                 prefix: str, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [intermediate, intermediate], bias=False, params_dtype=params_dtype,
            quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=False,
                                           params_dtype=params_dtype, quant_config=quant_config,
                                           prefix=f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor, gate_up: torch.Tensor | None = None) -> torch.Tensor:
        """`gate_up`: x's gate and up products, when the caller computed them (a MoE's stacked
        input product, for its shared expert)."""
        gate_up = gate_up if gate_up is not None else self.gate_up_proj(x)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def share_storage(layers: list[nn.Module]) -> torch.Tensor | None:
    """Put the weights of layers that read the same input into one tensor, row range after
    row range, each layer's `weight` a view of its range, so that one product computes them
    all (the loaders fill the views in place). None, and nothing changed, unless every layer
    is an unquantized linear without a bias on one device and dtype."""
    if len(layers) < 2 or any(layer.plain_weight() is None for layer in layers):
        return None
    weights = [layer.weight for layer in layers]
    first = weights[0]
    if any(w.shape[1] != first.shape[1] or w.dtype != first.dtype or w.device != first.device
           for w in weights):
        return None
    shared = torch.empty(sum(w.shape[0] for w in weights), first.shape[1], dtype=first.dtype,
                         device=first.device)
    start = 0
    for weight in weights:
        rows = weight.shape[0]
        shared[start:start + rows].copy_(weight.data)
        weight.data = shared[start:start + rows]
        start += rows
    return shared


class EngineMoE(nn.Module):
    def __init__(self, config: TextConfig, backend: MoEBackend, params_dtype: torch.dtype,
                 prefix: str, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        hidden, latent = config.hidden_size, config.moe_latent_size
        self.gate = ReplicatedLinear(hidden, config.num_experts, bias=False,
                                     params_dtype=params_dtype, quant_config=quant_config,
                                     prefix=f"{prefix}.gate")
        if latent:
            self.pooler = ReplicatedLinear(hidden, latent, bias=False,
                                           params_dtype=params_dtype, quant_config=quant_config,
                                           prefix=f"{prefix}.pooler")
            self.unpooler = ReplicatedLinear(latent, hidden, bias=False,
                                             params_dtype=params_dtype,
                                             quant_config=quant_config,
                                             prefix=f"{prefix}.unpooler")
        else:
            self.pooler = self.unpooler = None
        self.experts = FusedMoE(config.num_experts, config.expert_input_size,
                                config.moe_intermediate_size, config.expert_norm,
                                config.rms_norm_eps, params_dtype=params_dtype,
                                quant_config=quant_config, prefix=f"{prefix}.experts",
                                experts_kernel=backend.fused_experts)
        self.shared_expert = EngineMLP(
            hidden, config.moe_intermediate_size * config.num_shared_experts, params_dtype,
            f"{prefix}.shared_expert", quant_config) if config.num_shared_experts else None
        # The products that read the block's input (router, pooler, the shared expert's gate
        # and up) in one weight when they can be: a one-row step computes them in one launch.
        self._input_layers = [layer for layer in (
            self.gate, self.pooler,
            self.shared_expert.gate_up_proj if self.shared_expert is not None else None)
            if layer is not None]
        self._input_weight = share_storage(self._input_layers)

    def stacked_input_weight(self) -> torch.Tensor | None:
        """The weight of every product that reads the block's input, stacked (router rows,
        then the pooler's, then the shared expert's gate and up), when each is a plain
        product (adapters may be attached after loading: checked on every call)."""
        if self._input_weight is None or not STACKED_INPUTS_ON:
            return None
        if any(layer.plain_weight() is None for layer in self._input_layers):
            return None
        return self._input_weight

    def forward(self, x: torch.Tensor, dp_num_tokens: list[int] | None = None) -> torch.Tensor:
        """`dp_num_tokens`: every data-parallel rank's token count this step, when the
        experts are spread over data-parallel ranks (see `FusedMoE`)."""
        config = self.config
        logits, latent, shared_gate_up = self._input_products(x)
        weights, expert_ids = self.backend.route_topk(logits, config.num_experts_per_tok,
                                                      config.router_scoring,
                                                      config.norm_topk_prob)
        combined = self.experts(latent, weights, expert_ids, dp_num_tokens)
        out = self.unpooler(combined) if self.unpooler is not None else combined
        if self.shared_expert is not None:
            out = out + self.shared_expert(x, gate_up=shared_gate_up)
        return out

    def _input_products(self, x: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(router logits, the experts' input, the shared expert's gate and up or None): for
        a single row from one product over the stacked weight (one launch: 2.3% faster
        batch-1 decode on the 15B shape, H200), else from each layer's own product."""
        weight = self.stacked_input_weight() if x.shape[0] == 1 else None
        if weight is not None:
            parts = list(dense_linear(x, weight).split(
                [layer.output_size_per_partition for layer in self._input_layers], dim=-1))
            logits = parts.pop(0)
            latent = parts.pop(0) if self.pooler is not None else x
            return logits, latent, parts.pop(0) if parts else None
        return self.gate(x), self.pooler(x) if self.pooler is not None else x, None
