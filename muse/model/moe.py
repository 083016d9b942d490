"""Engine feed-forward blocks: the dense SwiGLU MLP and the latent MoE.

The latent MoE routes on the hidden state (every rank routes every token the same way), pools
to the latent width, runs the routed experts (`FusedMoE`: intermediate split over TP, or whole
experts split over EP) and unpools. The router, pooler and unpooler are small and replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from muse.config import TextConfig
from muse.kernels.backends import MoEBackend
from muse.layers.fused_moe import FusedMoE
from muse.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from muse.layers.quantization import QuantizationConfig


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


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

    def forward(self, x: torch.Tensor, dp_num_tokens: list[int] | None = None) -> torch.Tensor:
        """`dp_num_tokens`: every data-parallel rank's token count this step, when the
        experts are spread over data-parallel ranks (see `FusedMoE`)."""
        config = self.config
        weights, expert_ids = self.backend.route_topk(self.gate(x), config.num_experts_per_tok,
                                                      config.router_scoring,
                                                      config.norm_topk_prob)
        latent = self.pooler(x) if self.pooler is not None else x
        combined = self.experts(latent, weights, expert_ids, dp_num_tokens)
        out = self.unpooler(combined) if self.unpooler is not None else combined
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out
