"""Building blocks of the reference decoder: norm, attention, dense MLP and latent MoE."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from muse.config import TextConfig
from muse.rope import apply_rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, returned in the input dtype."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * normed).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class AttentionProjections(nn.Module):
    """The parameters of a GQA attention layer and the q/k/v computation both paths share."""

    def __init__(self, config: TextConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer_index]
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.sliding_window = config.layer_window(layer_index)
        self.scale = 1.0 / math.sqrt(self.head_dim)
        bias = config.attention_bias
        hidden, q_width = config.hidden_size, self.num_heads * self.head_dim
        kv_width = self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, q_width, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_width, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_width, bias=bias)
        self.o_proj = nn.Linear(q_width, hidden, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of shape x.shape[:-1] + (heads, head_dim), before norms and rotary."""
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        return q, k, v

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of shape x.shape[:-1] + (heads, head_dim): normed per head, then rotated."""
        q, k, v = self.project(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


class Attention(AttentionProjections):
    """Grouped-query attention over a whole (padded) batch, causal, optionally windowed."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor, key_padding: torch.Tensor | None) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.qkv(x, cos, sin)

        # Each KV head serves a group of consecutive query heads.
        group = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(group, dim=2)
        v = v.repeat_interleave(group, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * self.scale

        # Masks are built from positions, not indices, so left padding needs no special case.
        query_pos, key_pos = positions[:, :, None], positions[:, None, :]
        allowed = key_pos <= query_pos
        if self.sliding_window is not None:
            allowed &= key_pos > query_pos - self.sliding_window
        if key_padding is not None:
            allowed &= key_padding[:, None, :]
            # A padded query would see no key at all; let it see itself so softmax stays finite.
            allowed |= torch.eye(length, dtype=torch.bool, device=x.device)[None]
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        probs = scores.softmax(dim=-1)
        out = torch.einsum("bhqk,bkhd->bqhd", probs, v.float()).to(x.dtype)
        return self.o_proj(out.reshape(batch, length, -1))


class DenseMLP(nn.Module):
    """SwiGLU feed-forward block."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def route(router_logits: torch.Tensor, config: TextConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose `num_experts_per_tok` experts per token: (weights [N, k] float32, ids [N, k])."""
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if config.router_scoring == "softmax" else logits.sigmoid()
    weights, experts = scores.topk(config.num_experts_per_tok, dim=-1)
    if config.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class Experts(nn.Module):
    """All routed experts' weights stacked: gate and up fused, as in the checkpoint layout."""

    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        width, inter = config.expert_input_size, config.moe_intermediate_size
        self.intermediate = inter
        self.gate_up_proj = nn.Parameter(torch.empty(config.num_experts, 2 * inter, width))
        self.down_proj = nn.Parameter(torch.empty(config.num_experts, width, inter))
        self.norm_weight = nn.Parameter(torch.ones(config.num_experts, width)) \
            if config.expert_norm else None
        self.eps = config.rms_norm_eps
        # Set by trainers of models with few experts (`all_experts_forward`).
        self.all_experts_at_once = False

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor:
        """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]), in float32 so the oracle does not
        depend on the order experts are visited. (Called as a module, so wrappers such as
        PEFT's `target_parameters` LoRA apply to the stacked weights.)"""
        if self.all_experts_at_once:
            return self.all_experts_forward(x, expert_ids, weights)
        combined = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for expert in expert_ids.unique().tolist():
            token_ids, slot = (expert_ids == expert).nonzero(as_tuple=True)
            out = self.expert_forward(expert, x[token_ids])
            combined.index_add_(0, token_ids, out.float() * weights[token_ids, slot, None])
        return combined

    def all_experts_forward(self, x: torch.Tensor, expert_ids: torch.Tensor,
                            weights: torch.Tensor) -> torch.Tensor:
        """`forward`'s sums from every expert run on every token, each token's routing
        weights scattered over the experts (zero outside its top-k, so the other experts add
        exact zeros and get no gradient from it): a dozen batched ops and no host sync where
        the loop takes dozens of small ops and a sync per expert. E / k times the loop's
        products, which a trainer of a few small experts pays gladly: its step is bound by
        launching ops, not by arithmetic."""
        gate_up = torch.einsum("tw,ejw->tej", x, self.gate_up_proj)  # [T, E, 2I]
        gate, up = gate_up[..., :self.intermediate], gate_up[..., self.intermediate:]
        out = torch.einsum("tei,ewi->tew", F.silu(gate) * up, self.down_proj)  # [T, E, W]
        if self.norm_weight is not None:
            out = rms_norm(out, self.norm_weight, self.eps)
        dense = torch.zeros(x.shape[0], self.gate_up_proj.shape[0], dtype=torch.float32,
                            device=x.device).scatter(1, expert_ids, weights.float())
        return (out.float() * dense[..., None]).sum(dim=1)

    def expert_forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """One expert on its tokens: SwiGLU, then (optionally) the expert's own RMSNorm."""
        gate_up = x @ self.gate_up_proj[expert].t()
        gate, up = gate_up[..., :self.intermediate], gate_up[..., self.intermediate:]
        out = (F.silu(gate) * up) @ self.down_proj[expert].t()
        if self.norm_weight is not None:
            out = rms_norm(out, self.norm_weight[expert], self.eps)
        return out


class LatentMoE(nn.Module):
    """Router on the hidden state; experts at the latent width between a pooler and unpooler.

    out = unpooler(sum_k w_k * norm_k(expert_k(pooler(x)))) + shared(x)
    """

    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.gate = nn.Linear(hidden, config.num_experts, bias=False)
        if config.moe_latent_size:
            self.pooler = nn.Linear(hidden, config.moe_latent_size, bias=False)
            self.unpooler = nn.Linear(config.moe_latent_size, hidden, bias=False)
        else:
            self.pooler = self.unpooler = None
        self.experts = Experts(config)
        self.shared_expert = DenseMLP(
            hidden, config.moe_intermediate_size * config.num_shared_experts
        ) if config.num_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weights, experts = route(self.gate(tokens), self.config)
        latent = self.pooler(tokens) if self.pooler is not None else tokens
        combined = self.experts(latent, experts, weights).to(x.dtype)
        out = self.unpooler(combined) if self.unpooler is not None else combined
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        return out.reshape(shape)
